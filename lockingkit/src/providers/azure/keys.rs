//! How lock keys become guard blob names: [`AzureLockKeys`], re-exported as
//! `lockingkit::keys::AzureLockKeys`.

use sha2::{Digest, Sha256};

use crate::keys::push_escaped_byte;

/// The longest blob name Azure accepts, in characters.
const MAX_BLOB_NAME_CHARS: usize = 1024;
/// The most `/`-separated segments Azure accepts in a blob name.
const MAX_BLOB_NAME_SEGMENTS: usize = 254;

/// The infix that separates a semaphore's name from a slot number in a slot blob's name.
///
/// [`AzureLockKeys::guard_blob_name`] never produces `~s` except in its `~sha256~` prefix, so
/// no plain lock's guard blob contains it after the start.
const SLOT_INFIX: &str = "~slot~";

/// How lock keys become the names of their guard blobs inside the lock container.
///
/// A lock is one guard blob ([`guard_blob_name`](Self::guard_blob_name)); a semaphore of
/// `max_count` N is N slot blobs ([`semaphore_slot_blob_name`](Self::semaphore_slot_blob_name)).
/// Both are pure functions of the key, so an operator can find a key's blob and another program
/// can compute the same names.
///
/// ```
/// use lockingkit::keys::AzureLockKeys;
/// assert_eq!(AzureLockKeys::guard_blob_name("orders/42"), "orders/42");
/// assert_eq!(
///     AzureLockKeys::semaphore_slot_blob_name("jobs/export", 2),
///     "jobs/export~slot~2"
/// );
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct AzureLockKeys;

impl AzureLockKeys {
    /// The name of the guard blob of the lock `key`.
    ///
    /// ASCII letters, digits, `-`, `_`, `.` and `/` pass through, so `orders/42` becomes the
    /// blob `orders/42`. Every other UTF-8 byte, and `~` itself, becomes `~XX` (uppercase hex).
    /// A `/` or `.` is escaped too where Azure would rewrite the name: as the first or last
    /// character of the key, or right after a literal `/` (which would make an empty segment or
    /// a segment starting with a dot). A name longer than 1024 characters or with more than 254
    /// segments becomes `~sha256~` followed by the 64 lowercase hex digits of the SHA-256 of the
    /// key.
    ///
    /// Different keys always map to different names: the escaped form decodes unambiguously,
    /// and no escaped name starts with `~sha256~` followed by 64 hex digits (`~s` is never
    /// produced by escaping).
    ///
    /// ```
    /// use lockingkit::keys::AzureLockKeys;
    /// assert_eq!(AzureLockKeys::guard_blob_name("orders/42"), "orders/42");
    /// assert_eq!(AzureLockKeys::guard_blob_name("a//b"), "a/~2Fb");
    /// assert_eq!(AzureLockKeys::guard_blob_name("ключ"), "~D0~BA~D0~BB~D1~8E~D1~87");
    /// ```
    pub fn guard_blob_name(key: &str) -> String {
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
                    push_escaped_byte(&mut out, byte);
                }
                previous_was_literal_slash = false;
            }
        }
        // Every pushed character is ASCII, so the byte length is the character count.
        if out.len() > MAX_BLOB_NAME_CHARS || segments > MAX_BLOB_NAME_SEGMENTS {
            return hashed_blob_name(key);
        }
        out
    }

    /// The name of the guard blob of slot `slot` (from 0) of the semaphore `key`.
    ///
    /// A semaphore of `max_count` N on Azure is N guard blobs, one lease each; holding a slot is
    /// holding its blob's lease. The name is the key's [`guard_blob_name`](Self::guard_blob_name)
    /// followed by `~slot~` and the slot number in decimal: slot 2 of the semaphore
    /// `jobs/export` is the blob `jobs/export~slot~2`. When that would exceed Azure's 1024
    /// characters, the key part is hashed as for a plain guard:
    /// `~sha256~{64 lowercase hex}~slot~2`.
    ///
    /// Slot names never equal a plain lock's guard name (those never contain `~s` after their
    /// first character, and a hashed one is exactly 72 characters, all of its own), and
    /// different (key, slot) pairs never share a name: the first `~s` after the start marks
    /// where the key part ends, the key part decodes back to the key (or is its SHA-256), and
    /// the number has no leading zeros. Every process using a semaphore must give it the same
    /// `max_count`: the slots are shared by name, so a process that believes in more slots
    /// takes the extra ones too.
    ///
    /// ```
    /// use lockingkit::keys::AzureLockKeys;
    /// assert_eq!(
    ///     AzureLockKeys::semaphore_slot_blob_name("jobs/export", 2),
    ///     "jobs/export~slot~2"
    /// );
    /// assert_eq!(
    ///     AzureLockKeys::semaphore_slot_blob_name("ключ", 0),
    ///     "~D0~BA~D0~BB~D1~8E~D1~87~slot~0"
    /// );
    /// ```
    pub fn semaphore_slot_blob_name(key: &str, slot: u32) -> String {
        let base = Self::guard_blob_name(key);
        let named = format!("{base}{SLOT_INFIX}{slot}");
        // The suffix adds no `/`, so only the length can go over Azure's limits.
        if named.len() <= MAX_BLOB_NAME_CHARS {
            return named;
        }
        let mut hashed = hashed_blob_name(key);
        hashed.push_str(SLOT_INFIX);
        hashed.push_str(&slot.to_string());
        hashed
    }
}

/// `~sha256~` and the 64 lowercase hex digits of the SHA-256 of `key`: the name of a key whose
/// escaped name would be too long or too deep for Azure.
fn hashed_blob_name(key: &str) -> String {
    const LOWER_HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(key.as_bytes());
    let mut hashed = String::with_capacity(8 + 64 + SLOT_INFIX.len() + 10);
    hashed.push_str("~sha256~");
    for byte in digest {
        hashed.push(char::from(LOWER_HEX[usize::from(byte >> 4)]));
        hashed.push(char::from(LOWER_HEX[usize::from(byte & 0x0f)]));
    }
    hashed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{validate_key, MAX_KEY_CHARS};
    use proptest::prelude::*;

    /// Keys and their guard blob names, documented and computed by other programs.
    fn reference_vectors() -> Vec<(String, String)> {
        let v = |k: &str, b: &str| (k.to_string(), b.to_string());
        vec![
            v("orders/42", "orders/42"),
            v("jobs/nightly-export", "jobs/nightly-export"),
            v("a/b", "a/b"),
            v("a~2Fb", "a~7E2Fb"),
            v("a%2Fb", "a~252Fb"),
            v("..", "~2E~2E"),
            v(".", "~2E"),
            v("a.", "a~2E"),
            v("/a", "~2Fa"),
            v("a/", "a~2F"),
            v("a//b", "a/~2Fb"),
            v("a///b", "a/~2F/b"),
            v("a/./b", "a/~2E/b"),
            v("a/.b", "a/~2Eb"),
            v("ключ", "~D0~BA~D0~BB~D1~8E~D1~87"),
            v("🔒", "~F0~9F~94~92"),
            v("A b", "A~20b"),
            ("x".repeat(512), "x".repeat(512)),
            v(
                &"é".repeat(512),
                "~sha256~eb1dac068118a962d32331d185228c80c259c95630cefe7abae82a089d9ee68e",
            ),
            v(
                &format!("{}a", "a/".repeat(300)),
                "~sha256~d57e1b6c885037f85da86023d739c960fb7919c758932e07dfd6109f5279dc4b",
            ),
        ]
    }

    #[test]
    fn a_name_of_exactly_1024_characters_stays_readable_and_1025_is_hashed() {
        let at_limit = format!("{}a", "~".repeat(341));
        assert_eq!(
            AzureLockKeys::guard_blob_name(&at_limit).len(),
            MAX_BLOB_NAME_CHARS
        );
        assert_eq!(
            decode(&AzureLockKeys::guard_blob_name(&at_limit)),
            Some(at_limit)
        );
        let over = format!("{}ab", "~".repeat(341));
        assert_eq!(
            AzureLockKeys::guard_blob_name(&over),
            hashed_blob_name(&over)
        );
        let deepest = format!("{}a", "a/".repeat(MAX_BLOB_NAME_SEGMENTS - 1));
        assert_eq!(AzureLockKeys::guard_blob_name(&deepest), deepest);
        let deeper = format!("{}a", "a/".repeat(MAX_BLOB_NAME_SEGMENTS));
        assert_eq!(
            AzureLockKeys::guard_blob_name(&deeper),
            hashed_blob_name(&deeper)
        );
    }

    #[test]
    fn reference_vectors_keep_their_names() {
        for (key, blob) in reference_vectors() {
            assert_eq!(
                AzureLockKeys::guard_blob_name(&key),
                blob,
                "blob name of a {}-char key",
                key.chars().count()
            );
            // The 301-segment vector is 601 characters: a valid blob-name input, not a valid key.
            assert_eq!(
                validate_key(&key).is_ok(),
                key.chars().count() <= MAX_KEY_CHARS
            );
        }
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
        name.chars().count() <= MAX_BLOB_NAME_CHARS
            && name.split('/').count() <= MAX_BLOB_NAME_SEGMENTS
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
        let number = name[at..].strip_prefix(SLOT_INFIX)?;
        if number.len() > 1 && number.starts_with('0') {
            return None;
        }
        Some((&name[..at], number.parse().ok()?))
    }

    #[test]
    fn slot_names_extend_the_guard_name_and_hash_only_when_too_long() {
        assert_eq!(
            AzureLockKeys::semaphore_slot_blob_name("orders/42", 0),
            "orders/42~slot~0"
        );
        assert_eq!(
            AzureLockKeys::semaphore_slot_blob_name("a~2Fb", 31),
            "a~7E2Fb~slot~31"
        );
        assert_eq!(
            AzureLockKeys::semaphore_slot_blob_name("a/", 1),
            "a~2F~slot~1"
        );
        // 1018 characters of name plus `~slot~0` is 1025: the key part is hashed.
        let long = "~".repeat(339) + "a";
        assert_eq!(AzureLockKeys::guard_blob_name(&long).len(), 1018);
        let hashed = AzureLockKeys::semaphore_slot_blob_name(&long, 0);
        assert!(
            hashed.starts_with("~sha256~") && hashed.ends_with("~slot~0"),
            "{hashed}"
        );
        assert_eq!(hashed.len(), 8 + 64 + 7);
        // One character less fits exactly.
        let fits = "~".repeat(339);
        assert_eq!(
            AzureLockKeys::semaphore_slot_blob_name(&fits, 0).len(),
            1024
        );
        // A key whose guard is hashed already keeps that hash in its slot names.
        let many = "é".repeat(512);
        assert_eq!(
            AzureLockKeys::semaphore_slot_blob_name(&many, 7),
            format!("{}~slot~7", AzureLockKeys::guard_blob_name(&many))
        );
        assert_eq!(
            AzureLockKeys::semaphore_slot_blob_name(&"x".repeat(512), u32::MAX),
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
            let name = AzureLockKeys::semaphore_slot_blob_name(&key, slot);
            prop_assert!(is_valid_azure_name(&name), "invalid name {name:?}");
        }

        #[test]
        fn slot_names_never_equal_a_plain_guard_name(
            key in slot_key_strategy(),
            plain in key_strategy(),
            slot in any::<u32>(),
        ) {
            let name = AzureLockKeys::semaphore_slot_blob_name(&key, slot);
            // The semaphore `k` and the lock `k` are unrelated.
            prop_assert_ne!(&name, &AzureLockKeys::guard_blob_name(&key));
            prop_assert_ne!(&name, &AzureLockKeys::guard_blob_name(&plain));
            // Not even the plain lock of the very name an operator sees: the lock `k~slot~0`
            // escapes its `~`.
            prop_assert_ne!(&name, &AzureLockKeys::guard_blob_name(&name));
        }

        #[test]
        fn slot_names_split_back_into_the_key_and_the_slot(
            key in slot_key_strategy(),
            slot in any::<u32>(),
        ) {
            let name = AzureLockKeys::semaphore_slot_blob_name(&key, slot);
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
                AzureLockKeys::semaphore_slot_blob_name(&a, slot_a),
                AzureLockKeys::semaphore_slot_blob_name(&b, slot_b)
            );
        }

        #[test]
        fn every_slot_of_one_semaphore_has_its_own_name(key in slot_key_strategy()) {
            let names: std::collections::HashSet<String> =
                (0..64).map(|slot| AzureLockKeys::semaphore_slot_blob_name(&key, slot)).collect();
            prop_assert_eq!(names.len(), 64);
        }
    }

    proptest! {
        #[test]
        fn blob_names_are_valid_azure_names(key in key_strategy()) {
            let name = AzureLockKeys::guard_blob_name(&key);
            prop_assert!(is_valid_azure_name(&name), "invalid name {name:?}");
        }

        #[test]
        fn blob_names_decode_back_to_the_key(key in key_strategy()) {
            let name = AzureLockKeys::guard_blob_name(&key);
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
            let name = AzureLockKeys::guard_blob_name(&key);
            if escaped_len <= MAX_BLOB_NAME_CHARS {
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
            let name = AzureLockKeys::guard_blob_name(&key);
            if segments <= MAX_BLOB_NAME_SEGMENTS {
                prop_assert_eq!(&name, &key);
            } else {
                prop_assert!(name.starts_with("~sha256~") && name.len() == 8 + 64);
            }
        }

        #[test]
        fn distinct_keys_get_distinct_blob_names(a in key_strategy(), b in key_strategy()) {
            prop_assume!(a != b);
            prop_assert_ne!(AzureLockKeys::guard_blob_name(&a), AzureLockKeys::guard_blob_name(&b));
        }
    }
}
