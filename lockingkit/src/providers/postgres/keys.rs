//! How lock keys become advisory-lock numbers: [`PostgresLockKeys`], re-exported as
//! `lockingkit::keys::PostgresLockKeys`.

use sha2::{Digest, Sha256};

/// How lock keys become PostgreSQL advisory lock keys.
///
/// The advisory key is the first 8 bytes of the SHA-256 of the UTF-8 key, read as a big-endian
/// `bigint`. [`PostgresLockKeys::SQL_EXPRESSION`] computes the same value in SQL, so a script or
/// another service can take the very lock LockingKit takes. Two keys share an advisory key only
/// by a SHA-256 prefix collision, and then they merely exclude each other.
#[derive(Clone, Copy, Debug, Default)]
pub struct PostgresLockKeys;

impl PostgresLockKeys {
    /// SQL computing the advisory key of the text parameter `$1`.
    ///
    /// ```sql
    /// SELECT pg_try_advisory_lock(('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 16))::bit(64)::bigint);
    /// ```
    pub const SQL_EXPRESSION: &'static str =
        "('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 16))::bit(64)::bigint";

    /// The advisory key of `key`.
    ///
    /// ```
    /// use lockingkit::keys::PostgresLockKeys;
    /// assert_eq!(PostgresLockKeys::advisory_key("orders/42"), -4261225075031449721);
    /// ```
    pub fn advisory_key(key: &str) -> i64 {
        let digest = Sha256::digest(key.as_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        i64::from_be_bytes(first)
    }

    /// SQL computing the semaphore key of the text parameter `$1`: the first 4 bytes of the
    /// SHA-256 of the UTF-8 key as a big-endian `int4` (the high half of its advisory key).
    ///
    /// Slot `s` of the semaphore is the two-`int4` advisory lock `(semaphore key, s)`, so plain
    /// SQL takes slot 2 of the semaphore `$1` with
    ///
    /// ```sql
    /// SELECT pg_try_advisory_lock(('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 8))::bit(32)::int4, 2);
    /// ```
    ///
    /// The two-`int4` form is a lock space of its own (`objsubid = 2` in `pg_locks`, where
    /// `classid` is the semaphore key and `objid` the slot): a semaphore's slots never meet the
    /// `bigint` advisory locks of plain keys, which show `objsubid = 1`.
    pub const SEMAPHORE_SQL_EXPRESSION: &'static str =
        "('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 8))::bit(32)::int4";

    /// The semaphore key of `key`: its slots are the two-`int4` advisory locks
    /// `(semaphore_key(key), 0)` to `(semaphore_key(key), max_count - 1)`.
    ///
    /// Only 32 bits of the hash: two semaphores whose keys share their first 4 SHA-256 bytes
    /// (about one pair in 2³² — likely only among tens of thousands of semaphores) share their
    /// slots. Each still admits at most its own count, since a slot holds one holder whichever
    /// semaphore took it, but the two then admit fewer holders together than apart.
    ///
    /// ```
    /// use lockingkit::keys::PostgresLockKeys;
    /// assert_eq!(PostgresLockKeys::semaphore_key("orders/42"), -992143777);
    /// assert_eq!(PostgresLockKeys::semaphore_slot("orders/42", 2), (-992143777, 2));
    /// ```
    pub fn semaphore_key(key: &str) -> i32 {
        let digest = Sha256::digest(key.as_bytes());
        let mut first = [0u8; 4];
        first.copy_from_slice(&digest[..4]);
        i32::from_be_bytes(first)
    }

    /// The two-`int4` advisory lock of slot `slot` of the semaphore `key`: what
    /// `pg_advisory_lock(int4, int4)` takes, and what `pg_locks` shows as `classid` and `objid`
    /// with `objsubid = 2`.
    pub fn semaphore_slot(key: &str, slot: u16) -> (i32, i32) {
        (Self::semaphore_key(key), i32::from(slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Keys and their advisory keys, documented and computed by other programs.
    fn reference_vectors() -> Vec<(String, i64)> {
        let v = |k: &str, p: i64| (k.to_string(), p);
        vec![
            v("orders/42", -4261225075031449721),
            v("jobs/nightly-export", -6608059426078546604),
            v("a/b", -4517992508584211555),
            v("a~2Fb", -3104486523395018178),
            v("a%2Fb", 8581366813078647055),
            v("..", 6828011081595845693),
            v(".", -3624009932037567382),
            v("a.", 6536483355239894009),
            v("/a", 7660865432161832061),
            v("a/", -5486046568002236813),
            v("a//b", 8834601437433283040),
            v("a///b", 9163303817191787408),
            v("a/./b", 3620760808985749615),
            v("a/.b", -293456851317068515),
            v("ключ", 2153681812738117024),
            v("🔒", 7701668758205862634),
            v("A b", -6385909787353675517),
            ("x".repeat(512), 7212026910977811256),
            ("é".repeat(512), -1504857556536219294),
            (format!("{}a", "a/".repeat(300)), -3062980543607982088),
        ]
    }

    #[test]
    fn reference_vectors_keep_their_numbers() {
        for (key, advisory) in reference_vectors() {
            assert_eq!(PostgresLockKeys::advisory_key(&key), advisory);
        }
    }

    /// The semaphore keys of a few reference keys, computed from the rule (the first 4 bytes
    /// of SHA-256, big-endian) outside this crate.
    #[test]
    fn semaphore_keys_of_reference_keys() {
        for (key, expected) in [
            ("orders/42".to_owned(), -992143777),
            ("jobs/nightly-export".to_owned(), -1538558730),
            ("a/b".to_owned(), -1051927104),
            ("ключ".to_owned(), 501443122),
            ("🔒".to_owned(), 1793184494),
            ("x".repeat(512), 1679180867),
        ] {
            assert_eq!(PostgresLockKeys::semaphore_key(&key), expected);
            assert_eq!(PostgresLockKeys::semaphore_slot(&key, 0), (expected, 0));
            assert_eq!(
                PostgresLockKeys::semaphore_slot(&key, u16::MAX),
                (expected, 65535)
            );
        }
    }

    fn key_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z/.~%]{1,12}",
            proptest::collection::vec(any::<char>(), 1..30).prop_map(|v| v.into_iter().collect()),
            "é{300,512}",
        ]
    }

    proptest! {
        /// The semaphore key is the high half of the advisory key, so an operator finds a
        /// semaphore's slots under the same `classid` as the key's plain lock.
        #[test]
        fn semaphore_keys_are_the_high_half_of_advisory_keys(key in key_strategy()) {
            let advisory = PostgresLockKeys::advisory_key(&key);
            prop_assert_eq!(i64::from(PostgresLockKeys::semaphore_key(&key)), advisory >> 32);
        }
    }
}
