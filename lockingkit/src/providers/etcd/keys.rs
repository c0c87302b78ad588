//! How lock keys become etcd keys: [`EtcdLockKeys`], re-exported as
//! `lockingkit::keys::EtcdLockKeys`.

use crate::keys::push_escaped_byte;

/// How lock keys become etcd keys: one path segment per key, under a prefix of the provider's.
///
/// A key becomes one segment: ASCII letters, digits, `-`, `_` and `.` pass through, and every
/// other byte of its UTF-8 form (`/` and `~` included) becomes `~XX` (uppercase hex). The
/// segment never contains `/`, so the directory of one key is never a prefix of another's, and
/// decoding is unambiguous: two keys never share a directory. Under the provider's `key_prefix`
/// (default `lockingkit/`):
///
/// | etcd key | what |
/// |---|---|
/// | `{prefix}lock/{segment}/w/{id}` | a writer (plain lock) holding the key, or queued for it |
/// | `{prefix}lock/{segment}/r/{id}` | a reader holding the key, or queued for it |
/// | `{prefix}semaphore/{segment}/{id}` | a holder of the semaphore named by the key |
///
/// `{id}` is the writer's etcd lease id and a counter, both in lowercase hex
/// (`{lease:016x}-{n:x}`): unique per hold and per queue place, so no two processes ever write
/// the same key.
///
/// ```
/// use lockingkit::keys::EtcdLockKeys;
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
#[derive(Clone, Copy, Debug, Default)]
pub struct EtcdLockKeys;

impl EtcdLockKeys {
    /// The key as one path segment: `[A-Za-z0-9._-]` as is, every other UTF-8 byte as `~XX`.
    pub fn segment(key: &str) -> String {
        let mut segment = String::with_capacity(key.len());
        for byte in key.bytes() {
            if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.') {
                segment.push(char::from(byte));
            } else {
                push_escaped_byte(&mut segment, byte);
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Decodes an etcd segment: the inverse that makes the mapping injective.
    fn decode_etcd_segment(segment: &str) -> Option<Vec<u8>> {
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
    fn look_alike_keys_map_to_different_etcd_segments() {
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

    proptest! {
        #[test]
        fn etcd_segments_decode_back_and_never_hold_a_slash(key in "\\PC{1,64}") {
            let segment = EtcdLockKeys::segment(&key);
            prop_assert!(!segment.contains('/'));
            prop_assert_eq!(decode_etcd_segment(&segment), Some(key.into_bytes()));
        }

        #[test]
        fn no_etcd_directory_is_a_prefix_of_another(a in "\\PC{1,16}", b in "\\PC{1,16}") {
            prop_assume!(a != b);
            let (da, db) = (
                EtcdLockKeys::lock_directory("p/", &a),
                EtcdLockKeys::lock_directory("p/", &b),
            );
            prop_assert!(!da.starts_with(&db) && !db.starts_with(&da));
        }
    }
}
