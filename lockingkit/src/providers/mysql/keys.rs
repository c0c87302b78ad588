//! How lock keys become MySQL and MariaDB lock names: [`MysqlLockKeys`], re-exported as
//! `lockingkit::keys::MysqlLockKeys`.

use std::fmt::Write;

use sha2::{Digest, Sha256};

/// How lock keys become the names of MySQL and MariaDB user-level locks (`GET_LOCK`).
///
/// Lock names are at most 64 characters, and the servers compare them without regard to case,
/// so a key is never used as its own name: the name of a key is `lk:` followed by the first 60
/// hexadecimal digits (lowercase) of the SHA-256 of its UTF-8 bytes, 63 characters in all.
/// [`SQL_EXPRESSION`](Self::SQL_EXPRESSION) computes the same name in SQL, so a script or a
/// service in another language takes the very lock LockingKit takes. Two keys share a name
/// only by a 240-bit SHA-256 prefix collision.
///
/// Slot `s` of the semaphore named by a key is the lock `lks:` + the first 52 hexadecimal
/// digits + `:` + `s` in decimal: a namespace apart from plain keys, as semaphores are.
#[derive(Clone, Copy, Debug, Default)]
pub struct MysqlLockKeys;

/// The hexadecimal digits of the hash a plain key's name keeps.
const KEY_DIGITS: usize = 60;
/// The hexadecimal digits of the hash a semaphore slot's name keeps.
const SLOT_DIGITS: usize = 52;

impl MysqlLockKeys {
    /// SQL computing the lock name of the string parameter `?` (the connection's character set
    /// must encode the key as UTF-8, as `utf8mb4` does):
    ///
    /// ```sql
    /// SELECT GET_LOCK(CONCAT('lk:', LEFT(SHA2(CONVERT(? USING utf8mb4), 256), 60)), 0);
    /// ```
    pub const SQL_EXPRESSION: &'static str =
        "CONCAT('lk:', LEFT(SHA2(CONVERT(? USING utf8mb4), 256), 60))";

    /// SQL computing the name of slot `?` (the second parameter) of the semaphore named by the
    /// first:
    ///
    /// ```sql
    /// SELECT GET_LOCK(CONCAT('lks:', LEFT(SHA2(CONVERT(? USING utf8mb4), 256), 52), ':', ?), 0);
    /// ```
    pub const SEMAPHORE_SQL_EXPRESSION: &'static str =
        "CONCAT('lks:', LEFT(SHA2(CONVERT(? USING utf8mb4), 256), 52), ':', ?)";

    /// The lock name of `key`, as `IS_USED_LOCK` takes it and
    /// `performance_schema.metadata_locks` shows it (`OBJECT_NAME`, with `OBJECT_TYPE =
    /// 'USER LEVEL LOCK'`).
    ///
    /// ```
    /// use lockingkit::keys::MysqlLockKeys;
    /// assert_eq!(
    ///     MysqlLockKeys::lock_name("orders/42"),
    ///     "lk:c4dd165f06c35f87f80d9c755d8703efce751ab5c5f0efc6a819993f5762",
    /// );
    /// ```
    pub fn lock_name(key: &str) -> String {
        named("lk:", key, KEY_DIGITS)
    }

    /// The lock name of slot `slot` of the semaphore named by `key`.
    ///
    /// ```
    /// use lockingkit::keys::MysqlLockKeys;
    /// assert!(MysqlLockKeys::semaphore_slot("orders/42", 3).ends_with(":3"));
    /// ```
    pub fn semaphore_slot(key: &str, slot: u16) -> String {
        let mut name = named("lks:", key, SLOT_DIGITS);
        // Writing into a String cannot fail.
        let _ = write!(name, ":{slot}");
        name
    }
}

/// `prefix` followed by the first `digits` lowercase hexadecimal digits of SHA-256 of `key`.
fn named(prefix: &str, key: &str, digits: usize) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut name = String::with_capacity(prefix.len() + digits + 6);
    name.push_str(prefix);
    // Two digits per byte from a table: `write!` per byte cost more than the hash itself.
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for byte in digest.iter().take(digits.div_ceil(2)) {
        name.push(char::from(HEX[usize::from(byte >> 4)]));
        name.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    name.truncate(prefix.len() + digits);
    name
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn names_follow_the_documented_rule() {
        // SHA-256("orders/42"), computed outside this crate.
        let hex = "c4dd165f06c35f87f80d9c755d8703efce751ab5c5f0efc6a819993f5762";
        let full = format!("{:x}", Sha256::digest(b"orders/42"));
        assert!(full.starts_with(hex), "{full}");
        assert_eq!(MysqlLockKeys::lock_name("orders/42"), format!("lk:{hex}"));
        assert_eq!(
            MysqlLockKeys::semaphore_slot("orders/42", 1023),
            format!("lks:{}:1023", &hex[..52])
        );
    }

    fn key_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-zA-Z/.~%]{1,12}",
            proptest::collection::vec(any::<char>(), 1..30).prop_map(|v| v.into_iter().collect()),
            "é{300,512}",
        ]
    }

    proptest! {
        /// Every name fits the servers' 64-character limit, in characters that need no quoting
        /// and mean the same whatever the collation.
        #[test]
        fn names_fit_and_need_no_quoting(key in key_strategy(), slot in any::<u16>()) {
            for name in [MysqlLockKeys::lock_name(&key), MysqlLockKeys::semaphore_slot(&key, slot)] {
                prop_assert!(name.len() <= 64, "{}", name);
                prop_assert!(name.bytes().all(|b| b.is_ascii_digit() || b.is_ascii_lowercase() || b == b':'));
            }
        }

        /// Keys differing only in case (which the servers' comparison of names ignores) get
        /// different names, and a key's name is never any slot's name.
        #[test]
        fn distinct_keys_get_distinct_names(key in key_strategy(), slot in any::<u16>()) {
            let upper = key.to_uppercase();
            if upper != key {
                prop_assert_ne!(MysqlLockKeys::lock_name(&key), MysqlLockKeys::lock_name(&upper));
            }
            prop_assert_ne!(MysqlLockKeys::lock_name(&key), MysqlLockKeys::semaphore_slot(&key, slot));
        }
    }
}
