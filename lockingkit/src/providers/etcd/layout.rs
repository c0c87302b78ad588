//! Where the provider's keys live in etcd: a documented, injective mapping from LockingKit keys.
//!
//! A LockingKit key becomes one path segment: ASCII letters, digits, `-`, `_` and `.` pass
//! through, and every other byte of its UTF-8 form (`/` and `~` included) becomes `~XX`
//! (uppercase hex). The segment never contains `/`, so the directory of one key is never a
//! prefix of another's, and decoding is unambiguous: two keys never share a directory.
//!
//! Under the configured prefix (default `lockingkit/`):
//!
//! | etcd key | what |
//! |---|---|
//! | `{prefix}lock/{segment}/w/{id}` | a writer (plain lock) holding or queued for the key |
//! | `{prefix}lock/{segment}/r/{id}` | a reader holding the key |
//! | `{prefix}semaphore/{segment}/{id}` | a holder of the semaphore named by the key |
//!
//! `{id}` is the holder's etcd lease id and a counter, both in lowercase hex
//! (`{lease:016x}-{n:x}`): unique per hold and per queue place, so no two processes ever
//! write the same key.

/// The etcd keys of LockingKit locks and semaphores (see the module documentation).
///
/// ```
/// use lockingkit::providers::etcd::EtcdLockKeys;
///
/// assert_eq!(EtcdLockKeys::segment("orders/42"), "orders~2F42");
/// assert_eq!(
///     EtcdLockKeys::lock_directory("lockingkit/", "orders/42"),
///     "lockingkit/lock/orders~2F42/"
/// );
/// assert_eq!(
///     EtcdLockKeys::semaphore_directory("lockingkit/", "exports/tenant-7"),
///     "lockingkit/semaphore/exports~2Ftenant-7/"
/// );
/// ```
pub struct EtcdLockKeys;

impl EtcdLockKeys {
    /// The key as one path segment: `[A-Za-z0-9._-]` as is, every other UTF-8 byte as `~XX`.
    pub fn segment(key: &str) -> String {
        let mut segment = String::with_capacity(key.len());
        for byte in key.bytes() {
            if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.') {
                segment.push(char::from(byte));
            } else {
                segment.push('~');
                segment.push(hex_digit(byte >> 4));
                segment.push(hex_digit(byte & 0x0f));
            }
        }
        segment
    }

    /// The directory of the lock `key`: its writers (`w/`) and readers (`r/`) live under it.
    pub fn lock_directory(key_prefix: &str, key: &str) -> String {
        format!("{key_prefix}lock/{}/", Self::segment(key))
    }

    /// The directory of the semaphore `key`: one etcd key per holder.
    pub fn semaphore_directory(key_prefix: &str, key: &str) -> String {
        format!("{key_prefix}semaphore/{}/", Self::segment(key))
    }
}

fn hex_digit(nibble: u8) -> char {
    char::from(b"0123456789ABCDEF"[usize::from(nibble & 0x0f)])
}

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

/// The etcd keys of one lock or semaphore, as bytes.
#[derive(Clone, Debug)]
pub(super) struct Directory {
    /// Every key of the lock (or semaphore) starts with this.
    pub(super) all: Vec<u8>,
    /// Writers of a lock; empty for a semaphore.
    pub(super) writers: Vec<u8>,
    /// Readers of a lock; empty for a semaphore.
    pub(super) readers: Vec<u8>,
}

impl Directory {
    pub(super) fn lock(key_prefix: &str, key: &str) -> Self {
        let all = EtcdLockKeys::lock_directory(key_prefix, key);
        Directory {
            writers: format!("{all}w/").into_bytes(),
            readers: format!("{all}r/").into_bytes(),
            all: all.into_bytes(),
        }
    }

    pub(super) fn semaphore(key_prefix: &str, key: &str) -> Self {
        Directory {
            all: EtcdLockKeys::semaphore_directory(key_prefix, key).into_bytes(),
            writers: Vec::new(),
            readers: Vec::new(),
        }
    }

    /// A key under `within` (one of this directory's prefixes) named `id`.
    pub(super) fn entry(within: &[u8], id: &str) -> Vec<u8> {
        let mut key = within.to_vec();
        key.extend_from_slice(id.as_bytes());
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Decodes a segment: the inverse that makes the mapping injective.
    fn decode(segment: &str) -> Option<Vec<u8>> {
        let bytes = segment.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'~' {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        Some(out)
    }

    #[test]
    fn look_alike_keys_map_to_different_segments() {
        let keys = [
            "a/b", "a~2Fb", "a%2Fb", "..", ".", "a.", "/a", "a/", "a//b", "ключ", "🔒", "A b",
        ];
        let segments: std::collections::HashSet<String> =
            keys.iter().map(|k| EtcdLockKeys::segment(k)).collect();
        assert_eq!(segments.len(), keys.len());
        assert_eq!(EtcdLockKeys::segment("a/b"), "a~2Fb");
        assert_eq!(EtcdLockKeys::segment("a~2Fb"), "a~7E2Fb");
        assert_eq!(EtcdLockKeys::segment("ключ"), "~D0~BA~D0~BB~D1~8E~D1~87");
        assert_eq!(
            EtcdLockKeys::segment("jobs/nightly-export"),
            "jobs~2Fnightly-export"
        );
    }

    #[test]
    fn the_range_end_covers_exactly_the_prefix() {
        assert_eq!(
            range_end(b"lockingkit/lock/a/"),
            b"lockingkit/lock/a0".to_vec()
        );
        assert_eq!(range_end(&[b'a', 0xff]), b"b".to_vec());
        assert_eq!(range_end(&[0xff]), vec![0]);
    }

    proptest! {
        #[test]
        fn segments_decode_back_and_never_hold_a_slash(key in "\\PC{1,64}") {
            let segment = EtcdLockKeys::segment(&key);
            prop_assert!(!segment.contains('/'));
            prop_assert_eq!(decode(&segment), Some(key.into_bytes()));
        }

        #[test]
        fn no_directory_is_a_prefix_of_another(a in "\\PC{1,16}", b in "\\PC{1,16}") {
            prop_assume!(a != b);
            let (da, db) = (
                EtcdLockKeys::lock_directory("p/", &a),
                EtcdLockKeys::lock_directory("p/", &b),
            );
            prop_assert!(!da.starts_with(&db) && !db.starts_with(&da));
        }
    }
}
