//! Lock keys and how each backend names them.
//!
//! A key is 1–512 Unicode scalar values, compared byte for byte ([`validate_key`]). Each
//! provider maps a key to its backend's names with a unit type whose associated functions are
//! pure, public and stable, so an operator can find a key's guard blob, take the same advisory
//! lock from plain SQL, or list a lock's holders and waiters in etcd. Each is written beside its
//! provider and exists with that provider's feature:
//!
//! | type | feature | what a key becomes |
//! |---|---|---|
//! | `AzureLockKeys` | `azure` | the names of its guard blob and of a semaphore's slot blobs |
//! | `EtcdLockKeys` | `etcd` | a path segment, and the directories of its holders and waiters |
//! | `MysqlLockKeys` | `mysql` | a named-lock name (`GET_LOCK`), in Rust and in SQL; a semaphore's slot names |
//! | `PostgresLockKeys` | `postgres` | an advisory-lock number, in Rust and in SQL; a semaphore's two-`int4` slots |
//! | `RedisLockKeys` | `redis` | Redis key names sharing one Cluster hash slot (`RedisLockNames`, `RedisSemaphoreNames`) |

use crate::error::{ErrorKind, LockError};

#[cfg(feature = "azure")]
pub use crate::providers::azure::keys::AzureLockKeys;
#[cfg(feature = "etcd")]
pub use crate::providers::etcd::keys::EtcdLockKeys;
#[cfg(feature = "mysql")]
pub use crate::providers::mysql::keys::MysqlLockKeys;
#[cfg(feature = "postgres")]
pub use crate::providers::postgres::keys::PostgresLockKeys;
#[cfg(feature = "redis")]
pub use crate::providers::redis::keys::{RedisLockKeys, RedisLockNames, RedisSemaphoreNames};

/// The longest key, in Unicode scalar values (`str::chars().count()`).
pub const MAX_KEY_CHARS: usize = 512;

/// Checks that `key` is a valid lock key: 1 to [`MAX_KEY_CHARS`] characters.
///
/// The error never repeats the key, which may carry customer data.
pub fn validate_key(key: &str) -> Result<(), LockError> {
    if key.is_empty() {
        return Err(LockError::new(ErrorKind::InvalidKey, "the key is empty"));
    }
    // A key of at most 512 bytes has at most 512 characters; only longer byte strings need
    // counting, which keeps the check off the hot path for ordinary keys.
    if key.len() > MAX_KEY_CHARS && key.chars().count() > MAX_KEY_CHARS {
        return Err(LockError::new(
            ErrorKind::InvalidKey,
            format!("the key is longer than {MAX_KEY_CHARS} characters"),
        ));
    }
    Ok(())
}

/// Appends `byte` as `~XX`, two uppercase hex digits: the escape Azure's blob names and etcd's
/// path segments both write for a byte they cannot keep as it is.
#[cfg(any(feature = "azure", feature = "etcd"))]
pub(crate) fn push_escaped_byte(out: &mut String, byte: u8) {
    const UPPER_HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('~');
    out.push(char::from(UPPER_HEX[usize::from(byte >> 4)]));
    out.push(char::from(UPPER_HEX[usize::from(byte & 0x0f)]));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_overlong_keys_are_invalid() {
        assert_eq!(validate_key("").unwrap_err().kind(), ErrorKind::InvalidKey);
        let long = "x".repeat(513);
        let err = validate_key(&long).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidKey);
        assert!(
            !err.to_string().contains("xxx"),
            "the error must not echo the key"
        );
        // 512 four-byte characters are 2048 bytes but still a valid key.
        assert!(validate_key(&"🔒".repeat(512)).is_ok());
        assert!(validate_key(&"🔒".repeat(513)).is_err());
    }
}
