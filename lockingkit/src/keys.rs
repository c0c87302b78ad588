//! Lock keys and how each backend names them.
//!
//! A key is 1–512 Unicode scalar values, compared byte for byte. The mappings below are pure
//! functions, public and stable, so an operator can find a key's guard blob, take the same
//! advisory lock from plain SQL, or list a lock's holders and waiters in etcd.

use sha2::{Digest, Sha256};

use crate::error::{ErrorKind, LockError};

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

/// The longest blob name Azure accepts, in characters.
pub(crate) const AZURE_MAX_BLOB_NAME_CHARS: usize = 1024;
/// The most `/`-separated segments Azure accepts in a blob name.
pub(crate) const AZURE_MAX_BLOB_NAME_SEGMENTS: usize = 254;

/// Maps a lock key to the name of its guard blob inside the lock container.
///
/// ASCII letters, digits, `-`, `_`, `.` and `/` pass through, so `orders/42` becomes the blob
/// `orders/42`. Every other UTF-8 byte, and `~` itself, becomes `~XX` (uppercase hex). A `/` or
/// `.` is escaped too where Azure would rewrite the name: as the first or last character of the
/// key, or right after a literal `/` (which would make an empty segment or a segment starting
/// with a dot). A name longer than 1024 characters or with more than 254 segments becomes
/// `~sha256~` followed by the 64 lowercase hex digits of the SHA-256 of the key.
///
/// Different keys always map to different names: the escaped form decodes unambiguously, and
/// no escaped name starts with `~sha256~` followed by 64 hex digits (`~s` is never produced by
/// escaping).
///
/// ```
/// use lockingkit::keys::azure_blob_name;
/// assert_eq!(azure_blob_name("orders/42"), "orders/42");
/// assert_eq!(azure_blob_name("a//b"), "a/~2Fb");
/// assert_eq!(azure_blob_name("ключ"), "~D0~BA~D0~BB~D1~8E~D1~87");
/// ```
pub fn azure_blob_name(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 8);
    let mut previous_was_literal_slash = false;
    let char_count = key.chars().count();
    let mut segments = 1usize;
    for (index, c) in key.chars().enumerate() {
        let at_edge = index == 0 || index + 1 == char_count;
        let literal = match c {
            'A'..='Z' | 'a'..='z' | '0'..='9' | '-' | '_' => true,
            '/' | '.' => !at_edge && !previous_was_literal_slash,
            _ => false,
        };
        if literal {
            out.push(c);
            if c == '/' {
                segments += 1;
            }
            previous_was_literal_slash = c == '/';
        } else {
            let mut buf = [0u8; 4];
            for byte in c.encode_utf8(&mut buf).bytes() {
                push_escaped(&mut out, byte);
            }
            previous_was_literal_slash = false;
        }
    }
    // Every pushed character is ASCII, so the byte length is the character count.
    if out.len() > AZURE_MAX_BLOB_NAME_CHARS || segments > AZURE_MAX_BLOB_NAME_SEGMENTS {
        return hashed_blob_name(key);
    }
    out
}

/// `~sha256~` and the 64 lowercase hex digits of the SHA-256 of `key`: the name of a key whose
/// escaped name would be too long or too deep for Azure.
fn hashed_blob_name(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let mut hashed = String::with_capacity(8 + 64 + AZURE_SLOT_INFIX.len() + 10);
    hashed.push_str("~sha256~");
    for byte in digest {
        hashed.push(hex_digit(byte >> 4, false));
        hashed.push(hex_digit(byte & 0x0f, false));
    }
    hashed
}

fn push_escaped(out: &mut String, byte: u8) {
    out.push('~');
    out.push(hex_digit(byte >> 4, true));
    out.push(hex_digit(byte & 0x0f, true));
}

fn hex_digit(nibble: u8, upper: bool) -> char {
    let digits: &[u8; 16] = if upper {
        b"0123456789ABCDEF"
    } else {
        b"0123456789abcdef"
    };
    char::from(digits[usize::from(nibble & 0x0f)])
}

/// The infix that separates a semaphore's name from a slot number in a slot blob's name.
///
/// [`azure_blob_name`] never produces `~s` except in its `~sha256~` prefix, so no plain lock's
/// guard blob contains it after the start.
const AZURE_SLOT_INFIX: &str = "~slot~";

/// Maps a semaphore key and a slot number (from 0) to the name of that slot's guard blob.
///
/// A semaphore of `max_count` N on Azure is N guard blobs, one lease each; holding a slot is
/// holding its blob's lease. The name is the key's [`azure_blob_name`] followed by `~slot~`
/// and the slot number in decimal: slot 2 of the semaphore `jobs/export` is the blob
/// `jobs/export~slot~2`. When that would exceed Azure's 1024 characters, the key part is
/// hashed as for a plain guard: `~sha256~{64 lowercase hex}~slot~2`.
///
/// Slot names never equal a plain lock's guard name (those never contain `~s` after their
/// first character, and a hashed one is exactly 72 characters, all of its own), and different
/// (key, slot) pairs never share a name: the first `~s` after the start marks where the key
/// part ends, the key part decodes back to the key (or is its SHA-256), and the number has no
/// leading zeros. Every process using a semaphore must give it the same `max_count`: the slots
/// are shared by name, so a process that believes in more slots takes the extra ones too.
///
/// ```
/// use lockingkit::keys::azure_semaphore_slot_blob_name;
/// assert_eq!(azure_semaphore_slot_blob_name("jobs/export", 2), "jobs/export~slot~2");
/// assert_eq!(azure_semaphore_slot_blob_name("ключ", 0), "~D0~BA~D0~BB~D1~8E~D1~87~slot~0");
/// ```
pub fn azure_semaphore_slot_blob_name(key: &str, slot: u32) -> String {
    let base = azure_blob_name(key);
    let named = format!("{base}{AZURE_SLOT_INFIX}{slot}");
    // The suffix adds no `/`, so only the length can go over Azure's limits.
    if named.len() <= AZURE_MAX_BLOB_NAME_CHARS {
        return named;
    }
    let mut hashed = hashed_blob_name(key);
    hashed.push_str(AZURE_SLOT_INFIX);
    hashed.push_str(&slot.to_string());
    hashed
}

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
                segment.push('~');
                segment.push(upper_hex_digit(byte >> 4));
                segment.push(upper_hex_digit(byte & 0x0f));
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

fn upper_hex_digit(nibble: u8) -> char {
    char::from(b"0123456789ABCDEF"[usize::from(nibble & 0x0f)])
}

/// How lock keys become Redis key names, with a configurable prefix.
///
/// Every name has the form `{prefix}:{{tag}}{suffix}`, where `tag` is the lock key with `~`,
/// `{` and `}` written as `~7E`, `~7B` and `~7D`, and the prefix is escaped the same way. So
/// the first `{` of every name opens the tag and the first `}` after it closes it: Redis
/// Cluster hashes only the tag ([`hash_slot`](Self::hash_slot)), every name of one key lands in
/// the same slot whatever braces the key contains, and one script can touch them all. The
/// escaping is undone by replacing `~7B`, `~7D` and `~7E` back, so different keys (or prefixes)
/// never share a name.
///
/// | name | type | what |
/// |---|---|---|
/// | `lockingkit:{orders/42}` | string, expires | the exclusive holder: its holder id |
/// | `lockingkit:{orders/42}:readers` | sorted set, expires | readers: member the holder id, score the member's expiry (Unix ms) |
/// | `lockingkit:{orders/42}:intent` | string, expires | a writer waits for the readers: new readers are refused |
/// | `lockingkit:{orders/42}:fence` | string, expires after a day idle | the last fencing token of the lock and its readers |
/// | `lockingkit:{orders/42}:semaphore` | sorted set, expires | holders of the semaphore `orders/42`, as readers |
/// | `lockingkit:{orders/42}:semaphore:fence` | string, expires after a day idle | the semaphore's last fencing token |
///
/// Releases are published on the channel `lockingkit:{orders/42}:released` (channels are not
/// keys; the name only follows the same rule).
///
/// ```
/// use lockingkit::keys::RedisLockKeys;
/// let names = RedisLockKeys::lock("lockingkit", "orders/42");
/// assert_eq!(names.lock, "lockingkit:{orders/42}");
/// assert_eq!(names.fence, "lockingkit:{orders/42}:fence");
/// assert_eq!(RedisLockKeys::lock("lockingkit", "a}b{").lock, "lockingkit:{a~7Db~7B}");
/// assert_eq!(RedisLockKeys::hash_slot(&names.lock), RedisLockKeys::hash_slot("{orders/42}"));
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct RedisLockKeys;

/// The Redis names of one lock key: see [`RedisLockKeys`].
///
/// `Debug` leaves the names out: they contain the key, which may carry customer data.
#[derive(Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct RedisLockNames {
    /// The exclusive holder's string.
    pub lock: String,
    /// The readers' sorted set.
    pub readers: String,
    /// The waiting writer's intent.
    pub intent: String,
    /// The fencing counter of the lock and its readers.
    pub fence: String,
    /// The channel releases are published on.
    pub released: String,
}

/// The Redis names of one semaphore: see [`RedisLockKeys`].
///
/// `Debug` leaves the names out: they contain the key.
#[derive(Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct RedisSemaphoreNames {
    /// The holders' sorted set.
    pub holders: String,
    /// The semaphore's fencing counter.
    pub fence: String,
}

impl std::fmt::Debug for RedisLockNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLockNames").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for RedisSemaphoreNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSemaphoreNames")
            .finish_non_exhaustive()
    }
}

/// The number of Redis Cluster hash slots.
const REDIS_HASH_SLOTS: u16 = 16384;

impl RedisLockKeys {
    /// The prefix [`RedisOptions`](crate::providers::redis::RedisOptions) uses unless told
    /// otherwise.
    pub const DEFAULT_PREFIX: &'static str = "lockingkit";

    /// `text` with `~`, `{` and `}` written as `~7E`, `~7B` and `~7D`: the key as it appears
    /// between the braces of its names (the hash tag), or the prefix as it starts them.
    ///
    /// ```
    /// use lockingkit::keys::RedisLockKeys;
    /// assert_eq!(RedisLockKeys::hash_tag("a~2Fb"), "a~7E2Fb");
    /// assert_eq!(RedisLockKeys::hash_tag("{user}:1"), "~7Buser~7D:1");
    /// ```
    pub fn hash_tag(text: &str) -> String {
        let mut out = String::with_capacity(text.len() + 6);
        for c in text.chars() {
            match c {
                '~' => out.push_str("~7E"),
                '{' => out.push_str("~7B"),
                '}' => out.push_str("~7D"),
                c => out.push(c),
            }
        }
        out
    }

    /// `{prefix}:{{tag}}`, the common start of every name of `key`.
    fn base(prefix: &str, key: &str) -> String {
        let prefix = Self::hash_tag(prefix);
        let tag = Self::hash_tag(key);
        let mut base = String::with_capacity(prefix.len() + tag.len() + 3);
        base.push_str(&prefix);
        base.push_str(":{");
        base.push_str(&tag);
        base.push('}');
        base
    }

    /// The names of the lock `key` (its exclusive holder, readers, writer intent and fencing
    /// counter) under `prefix`.
    ///
    /// `key` should be a valid lock key (1 to 512 characters, see [`validate_key`]), as every
    /// key the engine hands a backend is: the mapping is injective and keeps one slot for any
    /// string, but the empty key's names are reserved (the Redis startup check publishes on
    /// its channel) and longer keys only make longer names.
    pub fn lock(prefix: &str, key: &str) -> RedisLockNames {
        let lock = Self::base(prefix, key);
        RedisLockNames {
            readers: format!("{lock}:readers"),
            intent: format!("{lock}:intent"),
            fence: format!("{lock}:fence"),
            released: format!("{lock}:released"),
            lock,
        }
    }

    /// The names of the semaphore `key` under `prefix`: a namespace apart from the lock `key`.
    /// `key` should be a valid lock key, as for [`lock`](Self::lock).
    pub fn semaphore(prefix: &str, key: &str) -> RedisSemaphoreNames {
        let holders = format!("{}:semaphore", Self::base(prefix, key));
        RedisSemaphoreNames {
            fence: format!("{holders}:fence"),
            holders,
        }
    }

    /// The Redis Cluster hash slot of the Redis key `name`, by the cluster's rule: CRC16
    /// (XMODEM) modulo 16384 of the text between the first `{` and the first `}` after it when
    /// that text is not empty, of the whole name otherwise. `CLUSTER KEYSLOT name` answers the
    /// same.
    ///
    /// ```
    /// use lockingkit::keys::RedisLockKeys;
    /// assert_eq!(RedisLockKeys::hash_slot("foo"), 12182); // as in the Redis Cluster spec
    /// assert_eq!(RedisLockKeys::hash_slot("lockingkit:{orders/42}"), 1029);
    /// ```
    pub fn hash_slot(name: &str) -> u16 {
        let bytes = name.as_bytes();
        let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
            let rest = &bytes[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        });
        crc16_xmodem(tagged.unwrap_or(bytes)) % REDIS_HASH_SLOTS
    }
}

/// CRC-16/XMODEM (polynomial 0x1021, initial value 0), the checksum of Redis Cluster's slots.
fn crc16_xmodem(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
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

    fn reference_vectors() -> Vec<(String, String, i64)> {
        let v = |k: &str, b: &str, p: i64| (k.to_string(), b.to_string(), p);
        vec![
            v("orders/42", "orders/42", -4261225075031449721),
            v(
                "jobs/nightly-export",
                "jobs/nightly-export",
                -6608059426078546604,
            ),
            v("a/b", "a/b", -4517992508584211555),
            v("a~2Fb", "a~7E2Fb", -3104486523395018178),
            v("a%2Fb", "a~252Fb", 8581366813078647055),
            v("..", "~2E~2E", 6828011081595845693),
            v(".", "~2E", -3624009932037567382),
            v("a.", "a~2E", 6536483355239894009),
            v("/a", "~2Fa", 7660865432161832061),
            v("a/", "a~2F", -5486046568002236813),
            v("a//b", "a/~2Fb", 8834601437433283040),
            v("a///b", "a/~2F/b", 9163303817191787408),
            v("a/./b", "a/~2E/b", 3620760808985749615),
            v("a/.b", "a/~2Eb", -293456851317068515),
            v("ключ", "~D0~BA~D0~BB~D1~8E~D1~87", 2153681812738117024),
            v("🔒", "~F0~9F~94~92", 7701668758205862634),
            v("A b", "A~20b", -6385909787353675517),
            ("x".repeat(512), "x".repeat(512), 7212026910977811256),
            v(
                &"é".repeat(512),
                "~sha256~eb1dac068118a962d32331d185228c80c259c95630cefe7abae82a089d9ee68e",
                -1504857556536219294,
            ),
            v(
                &format!("{}a", "a/".repeat(300)),
                "~sha256~d57e1b6c885037f85da86023d739c960fb7919c758932e07dfd6109f5279dc4b",
                -3062980543607982088,
            ),
        ]
    }

    #[test]
    fn a_name_of_exactly_1024_characters_stays_readable_and_1025_is_hashed() {
        let at_limit = format!("{}a", "~".repeat(341));
        assert_eq!(azure_blob_name(&at_limit).len(), AZURE_MAX_BLOB_NAME_CHARS);
        assert_eq!(decode(&azure_blob_name(&at_limit)), Some(at_limit));
        let over = format!("{}ab", "~".repeat(341));
        assert_eq!(azure_blob_name(&over), hashed_blob_name(&over));
        let deepest = format!("{}a", "a/".repeat(AZURE_MAX_BLOB_NAME_SEGMENTS - 1));
        assert_eq!(azure_blob_name(&deepest), deepest);
        let deeper = format!("{}a", "a/".repeat(AZURE_MAX_BLOB_NAME_SEGMENTS));
        assert_eq!(azure_blob_name(&deeper), hashed_blob_name(&deeper));
    }

    #[test]
    fn reference_vectors_keep_their_names_and_numbers() {
        for (key, blob, advisory) in reference_vectors() {
            assert_eq!(
                azure_blob_name(&key),
                blob,
                "blob name of a {}-char key",
                key.chars().count()
            );
            assert_eq!(PostgresLockKeys::advisory_key(&key), advisory);
            // The 301-segment vector is 601 characters: a valid blob-name input, not a valid key.
            assert_eq!(
                validate_key(&key).is_ok(),
                key.chars().count() <= MAX_KEY_CHARS
            );
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

    /// Undoes the escaping; `None` for the hashed form.
    fn decode(name: &str) -> Option<String> {
        if name.starts_with("~sha256~") {
            return None;
        }
        let bytes = name.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'~' {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        String::from_utf8(out).ok()
    }

    fn is_valid_azure_name(name: &str) -> bool {
        name.chars().count() <= AZURE_MAX_BLOB_NAME_CHARS
            && name.split('/').count() <= AZURE_MAX_BLOB_NAME_SEGMENTS
            && !name.starts_with('/')
            && !name.ends_with('/')
            && !name.ends_with('.')
            && !name.contains("//")
            && name.split('/').all(|segment| !segment.starts_with('.'))
            && name.is_ascii()
    }

    fn key_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z/.~%]{1,12}",
            "[a-zA-Z0-9/._~ -]{1,40}",
            proptest::collection::vec(any::<char>(), 1..30).prop_map(|v| v.into_iter().collect()),
            "(a/){100,300}a",
            "é{300,512}",
        ]
    }

    /// Splits a slot blob name into its key part and slot number, as an operator would.
    fn split_slot_name(name: &str) -> Option<(&str, u32)> {
        // The key part ends at the first `~s` after the start (a hashed key part starts with one).
        let at = name[1..].find("~s").map(|i| i + 1)?;
        let number = name[at..].strip_prefix(AZURE_SLOT_INFIX)?;
        if number.len() > 1 && number.starts_with('0') {
            return None;
        }
        Some((&name[..at], number.parse().ok()?))
    }

    #[test]
    fn slot_names_extend_the_guard_name_and_hash_only_when_too_long() {
        assert_eq!(
            azure_semaphore_slot_blob_name("orders/42", 0),
            "orders/42~slot~0"
        );
        assert_eq!(
            azure_semaphore_slot_blob_name("a~2Fb", 31),
            "a~7E2Fb~slot~31"
        );
        assert_eq!(azure_semaphore_slot_blob_name("a/", 1), "a~2F~slot~1");
        // 1018 characters of name plus `~slot~0` is 1025: the key part is hashed.
        let long = "~".repeat(339) + "a";
        assert_eq!(azure_blob_name(&long).len(), 1018);
        let hashed = azure_semaphore_slot_blob_name(&long, 0);
        assert!(
            hashed.starts_with("~sha256~") && hashed.ends_with("~slot~0"),
            "{hashed}"
        );
        assert_eq!(hashed.len(), 8 + 64 + 7);
        // One character less fits exactly.
        let fits = "~".repeat(339);
        assert_eq!(azure_semaphore_slot_blob_name(&fits, 0).len(), 1024);
        // A key whose guard is hashed already keeps that hash in its slot names.
        let many = "é".repeat(512);
        assert_eq!(
            azure_semaphore_slot_blob_name(&many, 7),
            format!("{}~slot~7", azure_blob_name(&many))
        );
        assert_eq!(
            azure_semaphore_slot_blob_name(&"x".repeat(512), u32::MAX),
            format!("{}~slot~4294967295", "x".repeat(512))
        );
    }

    /// Keys as `key_strategy`, plus keys whose guard name is 1005 to 1026 characters: their slot
    /// names fall either side of the 1024-character limit.
    fn slot_key_strategy() -> impl Strategy<Value = String> {
        prop_oneof![key_strategy(), "~{335,341}a{0,3}"]
    }

    proptest! {
        #[test]
        fn slot_names_are_valid_azure_names(key in slot_key_strategy(), slot in any::<u32>()) {
            let name = azure_semaphore_slot_blob_name(&key, slot);
            prop_assert!(is_valid_azure_name(&name), "invalid name {name:?}");
        }

        #[test]
        fn slot_names_never_equal_a_plain_guard_name(
            key in slot_key_strategy(),
            plain in key_strategy(),
            slot in any::<u32>(),
        ) {
            let name = azure_semaphore_slot_blob_name(&key, slot);
            // The semaphore `k` and the lock `k` are unrelated.
            prop_assert_ne!(&name, &azure_blob_name(&key));
            prop_assert_ne!(&name, &azure_blob_name(&plain));
            // Not even the plain lock of the very name an operator sees: the lock `k~slot~0`
            // escapes its `~`.
            prop_assert_ne!(&name, &azure_blob_name(&name));
        }

        #[test]
        fn slot_names_split_back_into_the_key_and_the_slot(
            key in slot_key_strategy(),
            slot in any::<u32>(),
        ) {
            let name = azure_semaphore_slot_blob_name(&key, slot);
            let (base, number) = split_slot_name(&name).expect("a slot name splits");
            prop_assert_eq!(number, slot);
            match decode(base) {
                Some(decoded) => prop_assert_eq!(decoded, key),
                None => prop_assert!(base.starts_with("~sha256~") && base.len() == 8 + 64),
            }
        }

        #[test]
        fn distinct_keys_or_slots_get_distinct_slot_names(
            a in slot_key_strategy(),
            b in slot_key_strategy(),
            slot_a in 0u32..40,
            slot_b in 0u32..40,
        ) {
            prop_assume!(a != b || slot_a != slot_b);
            prop_assert_ne!(
                azure_semaphore_slot_blob_name(&a, slot_a),
                azure_semaphore_slot_blob_name(&b, slot_b)
            );
        }

        #[test]
        fn every_slot_of_one_semaphore_has_its_own_name(key in slot_key_strategy()) {
            let names: std::collections::HashSet<String> =
                (0..64).map(|slot| azure_semaphore_slot_blob_name(&key, slot)).collect();
            prop_assert_eq!(names.len(), 64);
        }
    }

    proptest! {
        #[test]
        fn blob_names_are_valid_azure_names(key in key_strategy()) {
            let name = azure_blob_name(&key);
            prop_assert!(is_valid_azure_name(&name), "invalid name {name:?}");
        }

        #[test]
        fn blob_names_decode_back_to_the_key(key in key_strategy()) {
            let name = azure_blob_name(&key);
            match decode(&name) {
                Some(decoded) => prop_assert_eq!(decoded, key),
                None => prop_assert!(name.len() == 8 + 64),
            }
        }

        /// Keys whose escaped name is within a few characters of the 1024 limit, either side:
        /// `~` escapes to three characters and `a` stays one, mixed in any order.
        #[test]
        fn names_at_and_around_1024_characters_are_hashed_exactly_above_it(
            escaped_len in 1000usize..=1048,
            order in any::<u64>(),
        ) {
            let tildes = escaped_len / 3;
            let letters = escaped_len - tildes * 3;
            let mut key: Vec<char> = std::iter::repeat_n('~', tildes)
                .chain(std::iter::repeat_n('a', letters))
                .collect();
            // A cheap deterministic shuffle from the generated seed.
            let mut seed = order | 1;
            for i in (1..key.len()).rev() {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                key.swap(i, (seed % (i as u64 + 1)) as usize);
            }
            let key: String = key.into_iter().collect();
            prop_assert!(validate_key(&key).is_ok());
            let name = azure_blob_name(&key);
            if escaped_len <= AZURE_MAX_BLOB_NAME_CHARS {
                prop_assert_eq!(name.len(), escaped_len);
                prop_assert_eq!(decode(&name), Some(key));
            } else {
                prop_assert!(name.starts_with("~sha256~") && name.len() == 8 + 64, "{}", name.len());
            }
        }

        /// Keys of 250 to 258 segments: at most 254 stay readable, more are hashed.
        #[test]
        fn names_at_and_around_254_segments_are_hashed_exactly_above_it(
            segments in 250usize..=258,
            segment in "[a-z0-9]{1,2}",
        ) {
            let key = vec![segment.as_str(); segments].join("/");
            prop_assume!(validate_key(&key).is_ok());
            let name = azure_blob_name(&key);
            if segments <= AZURE_MAX_BLOB_NAME_SEGMENTS {
                prop_assert_eq!(&name, &key);
            } else {
                prop_assert!(name.starts_with("~sha256~") && name.len() == 8 + 64);
            }
        }

        /// The semaphore key is the high half of the advisory key, so an operator finds a
        /// semaphore's slots under the same `classid` as the key's plain lock.
        #[test]
        fn semaphore_keys_are_the_high_half_of_advisory_keys(key in key_strategy()) {
            let advisory = PostgresLockKeys::advisory_key(&key);
            prop_assert_eq!(i64::from(PostgresLockKeys::semaphore_key(&key)), advisory >> 32);
        }

        #[test]
        fn distinct_keys_get_distinct_blob_names(a in key_strategy(), b in key_strategy()) {
            prop_assume!(a != b);
            prop_assert_ne!(azure_blob_name(&a), azure_blob_name(&b));
        }
    }
}

#[cfg(test)]
mod redis_tests {
    use super::*;
    use proptest::prelude::*;

    /// Every name of `key` under `prefix`, lock and semaphore, with the channel.
    fn all_names(prefix: &str, key: &str) -> Vec<String> {
        let lock = RedisLockKeys::lock(prefix, key);
        let semaphore = RedisLockKeys::semaphore(prefix, key);
        vec![
            lock.lock,
            lock.readers,
            lock.intent,
            lock.fence,
            lock.released,
            semaphore.holders,
            semaphore.fence,
        ]
    }

    /// Splits a name back into prefix, key and suffix, undoing the escapes: what an operator's
    /// script in another language would do.
    fn parse(name: &str) -> Option<(String, String, &str)> {
        let open = name.find(":{")?;
        let rest = &name[open + 2..];
        let close = rest.find('}')?;
        Some((
            unescape(&name[..open])?,
            unescape(&rest[..close])?,
            &rest[close + 1..],
        ))
    }

    fn unescape(text: &str) -> Option<String> {
        let mut out = String::new();
        let mut rest = text;
        while let Some(at) = rest.find('~') {
            out.push_str(&rest[..at]);
            let escape = rest.get(at..at + 3)?;
            out.push(match escape {
                "~7E" => '~',
                "~7B" => '{',
                "~7D" => '}',
                _ => return None,
            });
            rest = &rest[at + 3..];
        }
        out.push_str(rest);
        Some(out)
    }

    /// The documented vectors (docs/redis.md): names under the default prefix, and the slot
    /// every name of the key shares.
    #[test]
    fn documented_vectors() {
        let vectors: Vec<(String, String, u16)> = vec![
            ("orders/42".into(), "lockingkit:{orders/42}".into(), 1029),
            ("a{b}c".into(), "lockingkit:{a~7Bb~7Dc}".into(), 15370),
            ("a~7Bb}c".into(), "lockingkit:{a~7E7Bb~7Dc}".into(), 10821),
            ("{}".into(), "lockingkit:{~7B~7D}".into(), 15034),
            ("}".into(), "lockingkit:{~7D}".into(), 5963),
            ("ключ".into(), "lockingkit:{ключ}".into(), 10303),
            (
                "x".repeat(512),
                format!("lockingkit:{{{}}}", "x".repeat(512)),
                3103,
            ),
        ];
        for (key, lock, slot) in vectors {
            let names = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key);
            assert_eq!(names.lock, lock);
            for name in all_names(RedisLockKeys::DEFAULT_PREFIX, &key) {
                assert_eq!(RedisLockKeys::hash_slot(&name), slot, "{name}");
            }
        }
        let semaphore = RedisLockKeys::semaphore("app", "jobs/export");
        assert_eq!(semaphore.holders, "app:{jobs/export}:semaphore");
        assert_eq!(semaphore.fence, "app:{jobs/export}:semaphore:fence");
        assert_eq!(
            RedisLockKeys::lock("my{app}", "k").lock,
            "my~7Bapp~7D:{k}",
            "braces in the prefix are escaped too, so they never make the tag"
        );
    }

    #[test]
    fn slots_follow_the_cluster_spec() {
        // The examples of the Redis Cluster specification, and CRC-16/XMODEM's check value.
        assert_eq!(crc16_xmodem(b"123456789"), 0x31C3);
        assert_eq!(RedisLockKeys::hash_slot("foo"), 12182);
        assert_eq!(
            RedisLockKeys::hash_slot("{user1000}.following"),
            RedisLockKeys::hash_slot("user1000")
        );
        // An empty tag hashes the whole name; only the first `{` and the first `}` after it count.
        assert_eq!(
            RedisLockKeys::hash_slot("foo{}{bar}"),
            crc16_xmodem(b"foo{}{bar}") % REDIS_HASH_SLOTS
        );
        assert_eq!(
            RedisLockKeys::hash_slot("foo{{bar}}zap"),
            RedisLockKeys::hash_slot("{bar")
        );
        assert_eq!(
            RedisLockKeys::hash_slot("foo{bar}{zap}"),
            RedisLockKeys::hash_slot("bar")
        );
    }

    fn key_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a{}~7BDE:/]{1,12}",
            "[a-z{}~]{1,40}",
            proptest::collection::vec(any::<char>(), 1..30).prop_map(|v| v.into_iter().collect()),
            "[{}~]{500,512}",
            "é{512}",
        ]
    }

    fn prefix_strategy() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(RedisLockKeys::DEFAULT_PREFIX.to_owned()),
            "[a-z:{}~]{1,10}"
        ]
    }

    proptest! {
        #[test]
        fn every_name_of_a_key_is_in_the_slot_of_its_tag(
            prefix in prefix_strategy(),
            key in key_strategy(),
        ) {
            let tag = RedisLockKeys::hash_tag(&key);
            let slot = crc16_xmodem(tag.as_bytes()) % REDIS_HASH_SLOTS;
            for name in all_names(&prefix, &key) {
                // The tag Redis sees is exactly the escaped key, whatever braces key and
                // prefix contain.
                let open = name.find('{').expect("a tag");
                let close = name[open..].find('}').expect("a closed tag") + open;
                prop_assert_eq!(&name[open + 1..close], tag.as_str());
                prop_assert_eq!(RedisLockKeys::hash_slot(&name), slot);
            }
        }

        #[test]
        fn names_parse_back_to_their_prefix_and_key(
            prefix in prefix_strategy(),
            key in key_strategy(),
        ) {
            let suffixes = ["", ":readers", ":intent", ":fence", ":released", ":semaphore",
                ":semaphore:fence"];
            for (name, suffix) in all_names(&prefix, &key).iter().zip(suffixes) {
                let (p, k, s) = parse(name).expect("a name parses");
                prop_assert_eq!(&p, &prefix);
                prop_assert_eq!(&k, &key);
                prop_assert_eq!(s, suffix);
            }
        }

        #[test]
        fn different_keys_or_prefixes_never_share_a_name(
            a in key_strategy(),
            b in key_strategy(),
            prefix_a in prefix_strategy(),
            prefix_b in prefix_strategy(),
        ) {
            prop_assume!(a != b || prefix_a != prefix_b);
            let names_a = all_names(&prefix_a, &a);
            for name in all_names(&prefix_b, &b) {
                prop_assert!(!names_a.contains(&name), "{name:?} shared");
            }
        }

        #[test]
        fn the_names_of_one_key_are_all_different(key in key_strategy()) {
            let names = all_names(RedisLockKeys::DEFAULT_PREFIX, &key);
            let distinct: std::collections::HashSet<&String> = names.iter().collect();
            prop_assert_eq!(distinct.len(), names.len());
        }
    }

    #[test]
    fn look_alike_keys_get_different_names_in_one_slot_each() {
        let keys = [
            "a{b}",
            "a~7Bb~7D",
            "a~7Eb",
            "a~b",
            "{a}b",
            "a}{b",
            "{",
            "}",
            "~",
            "~7B",
            "a:b",
            "a}:readers",
            "a:{b}",
        ];
        let mut seen = std::collections::HashSet::new();
        for key in keys {
            for name in all_names("p", key) {
                assert!(seen.insert(name.clone()), "{name} appears twice");
            }
        }
    }
}
