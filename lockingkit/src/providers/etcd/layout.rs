//! The etcd keys of one lock and of one semaphore, as bytes (the mapping itself is
//! [`EtcdLockKeys`], documented with the others in [`crate::keys`]).

use super::keys::EtcdLockKeys;

/// The end of the range of every key that starts with `prefix` (which ends with `/`): the
/// prefix with its last byte incremented.
pub(super) fn range_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return end;
        }
    }
    // Only a prefix of 0xFF bytes has no end: the range runs to the end of the keyspace.
    vec![0]
}

/// A key under `within` (a directory prefix) named `id`.
pub(super) fn entry(within: &[u8], id: &str) -> Vec<u8> {
    let mut key = within.to_vec();
    key.extend_from_slice(id.as_bytes());
    key
}

/// The keys of the lock (reader-writer lock) of one LockingKit key.
#[derive(Clone, Debug)]
pub(super) struct LockDirectory {
    /// Every writer and reader key of the lock starts with this.
    pub(super) all: Vec<u8>,
    /// Writers: plain locks, holding or queued.
    pub(super) writers: Vec<u8>,
    /// Readers, holding or queued.
    pub(super) readers: Vec<u8>,
}

impl LockDirectory {
    pub(super) fn new(key_prefix: &str, key: &str) -> Self {
        let all = EtcdLockKeys::lock_directory(key_prefix, key);
        LockDirectory {
            writers: format!("{all}w/").into_bytes(),
            readers: format!("{all}r/").into_bytes(),
            all: all.into_bytes(),
        }
    }
}

/// The keys of the semaphore named by one LockingKit key: one per holder.
#[derive(Clone, Debug)]
pub(super) struct SemaphoreDirectory {
    pub(super) all: Vec<u8>,
}

impl SemaphoreDirectory {
    pub(super) fn new(key_prefix: &str, key: &str) -> Self {
        SemaphoreDirectory {
            all: EtcdLockKeys::semaphore_directory(key_prefix, key).into_bytes(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_range_end_covers_exactly_the_prefix() {
        assert_eq!(
            range_end(b"lockingkit/lock/a/"),
            b"lockingkit/lock/a0".to_vec()
        );
        assert_eq!(range_end(&[b'a', 0xff]), b"b".to_vec());
        assert_eq!(range_end(&[0xff]), vec![0]);
    }

    #[test]
    fn a_locks_writers_and_readers_live_under_its_directory() {
        let directory = LockDirectory::new("lockingkit/", "orders/42");
        assert_eq!(directory.all, b"lockingkit/lock/orders~2F42/".to_vec());
        assert_eq!(
            directory.writers,
            b"lockingkit/lock/orders~2F42/w/".to_vec()
        );
        assert_eq!(
            directory.readers,
            b"lockingkit/lock/orders~2F42/r/".to_vec()
        );
        assert_eq!(
            SemaphoreDirectory::new("p/", "s").all,
            b"p/semaphore/s/".to_vec()
        );
    }
}
