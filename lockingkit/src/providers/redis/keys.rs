//! How lock keys become Redis key names: [`RedisLockKeys`] and the names it gives
//! ([`RedisLockNames`], [`RedisSemaphoreNames`]), re-exported under `lockingkit::keys`.

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
    /// `key` should be a valid lock key (1 to 512 characters, see
    /// [`validate_key`](crate::keys::validate_key)), as every key the engine hands a backend is:
    /// the mapping is injective and keeps one slot for any string, but the empty key's names
    /// are reserved (the Redis startup check publishes on its channel) and longer keys only make
    /// longer names.
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
