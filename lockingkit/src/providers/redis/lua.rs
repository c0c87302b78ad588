//! The lock protocol: one Lua script per step, each touching the keys of one hash slot (see
//! [`RedisLockKeys`](crate::keys::RedisLockKeys)), so every step is one round trip and works
//! on Redis Cluster. The sources are public so another program can take the very same locks:
//! each is a plain Lua file in this module's folder (`src/providers/redis/lua/*.lua`, shown
//! below each constant), complete as it is sent, whose header names its `KEYS[i]`, its
//! `ARGV[i]`, its answers and what it publishes. Run one with `EVAL`, or load it (`SCRIPT
//! LOAD`) and run it with `EVALSHA`; its SHA-1 is that of the file.
//!
//! | step | exclusive (a writer, or a plain lock) | shared (a reader) | semaphore |
//! |---|---|---|---|
//! | take | [`ACQUIRE`] | [`ACQUIRE_SHARED`] | [`ACQUIRE_SLOT`] |
//! | renew | [`RENEW`] | [`RENEW_MEMBER`] | [`RENEW_MEMBER`] |
//! | give back | [`RELEASE`] | [`RELEASE_MEMBER`] (publishing) | [`RELEASE_MEMBER`] (silent) |
//!
//! # The release message
//! Releasing a plain lock, a writer or a reader publishes the message `released` (those eight
//! bytes, nothing else) on the key's channel `<prefix>:{<tag>}:released`
//! ([`RedisLockNames::released`](crate::keys::RedisLockNames::released)); a waiter subscribes
//! to it and tries again when it arrives. A release that finds no such holder publishes
//! nothing, nor does a semaphore release, nor a lease that expires: waiters poll for those.
//! The startup check publishes `check` on the channel of the empty key, which no lock has.
//!
//! A holder is identified by a random *holder id*: the value of the lock's string, or a member
//! of a readers' or a semaphore's sorted set whose score is its expiry in Unix milliseconds by
//! the server's clock. Scripts read the clock with `TIME` and are replicated by their effects
//! (the only mode since Redis 7), so replicas store the same expiries.
//!
//! # Fencing tokens
//! A token is `max(last + 1, now)`, where `last` is the counter's value (0 when it is missing)
//! and `now` the server's clock in microseconds since 1970, and becomes the counter's new
//! value. The counter expires after a day without a new token, so idle keys cost no memory.
//! So tokens grow strictly while the counter lives, and keep growing when it is gone — after
//! a restart without persistence, a failover to a replica that had not received it, a day
//! idle — as long as the server's clock then reads later than the last token, in
//! microseconds. That holds unless the clock was set back by more than the time since the last
//! token, or a key minted more than a million tokens a second (a script alone takes longer).
//! Tokens fit JavaScript's and Lua's doubles exactly until the year 2255. A counter at
//! 2^53 − 1 (set so by hand: the clock gets there in 2255) mints nothing: the attempt is
//! answered with the error `FENCING`, as no greater token would be exact.

/// Declares a script from its file, with the file's text in its docs.
macro_rules! script {
    ($(#[$doc:meta])* $name:ident = $file:literal) => {
        $(#[$doc])*
        ///
        /// ```lua
        #[doc = include_str!($file)]
        /// ```
        pub const $name: &str = include_str!($file);
    };
}

script!(
    /// Takes the lock exclusively (a writer, or a plain lock): KEYS `lock`, `readers`, `intent`,
    /// `fence` of [`RedisLockKeys::lock`]; ARGV a holder id, the lease and the writer's intent
    /// in milliseconds. Answers the fencing token, or 0 when the lock is held or read (setting
    /// the intent when it found live readers).
    ///
    /// [`RedisLockKeys::lock`]: crate::keys::RedisLockKeys::lock
    ACQUIRE = "lua/acquire.lua"
);

script!(
    /// Takes the lock shared (a reader): KEYS as [`ACQUIRE`]; ARGV a holder id and the lease in
    /// milliseconds. Answers the fencing token, or 0 while a writer holds the lock or its
    /// intent stands.
    ACQUIRE_SHARED = "lua/acquire_shared.lua"
);

script!(
    /// Takes a place in a semaphore: KEYS `holders`, `fence` of [`RedisLockKeys::semaphore`];
    /// ARGV a holder id, the lease in milliseconds and the semaphore's count. Answers the
    /// fencing token, or 0 when `count` live holders are there.
    ///
    /// [`RedisLockKeys::semaphore`]: crate::keys::RedisLockKeys::semaphore
    ACQUIRE_SLOT = "lua/acquire_slot.lua"
);

script!(
    /// Renews an exclusive hold: KEYS `lock`; ARGV the holder id and the lease in milliseconds.
    /// Answers 1 when extended, 0 when the lock is gone or another holder's.
    RENEW = "lua/renew.lua"
);

script!(
    /// Renews a reader or a semaphore holder: KEYS `readers` or `holders`; ARGV the holder id
    /// and the lease in milliseconds. Answers 1 when extended, 0 when the member is gone or
    /// expired.
    RENEW_MEMBER = "lua/renew_member.lua"
);

script!(
    /// Releases an exclusive hold: KEYS `lock`; ARGV the holder id and the key's `released`
    /// channel. Answers 1 when deleted — and then publishes `released` on the channel, best
    /// effort — or 0 when the lock was gone or another holder's.
    RELEASE = "lua/release.lua"
);

script!(
    /// Releases a reader or a semaphore holder: KEYS `readers` or `holders`; ARGV the holder id
    /// and the channel to publish `released` on (a reader's key's `released` channel; empty for
    /// a semaphore, which publishes nothing). Answers 1 when a live member was removed, 0 when
    /// it was gone or had expired.
    RELEASE_MEMBER = "lua/release_member.lua"
);

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [&str; 7] = [
        ACQUIRE,
        ACQUIRE_SHARED,
        ACQUIRE_SLOT,
        RENEW,
        RENEW_MEMBER,
        RELEASE,
        RELEASE_MEMBER,
    ];

    /// The helpers each script that needs them carries whole (so each file runs as it is):
    /// one text for each, wherever it appears.
    const HELPERS: [(&str, &str); 3] = [
        (
            "now_ms",
            "local function now_ms(t) return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end\n",
        ),
        (
            "mint",
            "local function mint(fence, t)\n\
             \x20 local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])\n\
             \x20 local last = tonumber(redis.call('GET', fence) or '0') or 0\n\
             \x20 if last >= 9007199254740991 then\n\
             \x20   error(redis.error_reply('FENCING the fencing counter is at 2^53-1: no greater token is exact'))\n\
             \x20 end\n\
             \x20 local token = math.max(last + 1, floor)\n\
             \x20 redis.call('SET', fence, string.format('%d', token), 'PX', 86400000)\n\
             \x20 return token\n\
             end\n",
        ),
        (
            "hold",
            "local function hold(set, member, until_ms, lease)\n\
             \x20 redis.call('ZADD', set, until_ms, member)\n\
             \x20 if redis.call('PTTL', set) < tonumber(lease) then redis.call('PEXPIRE', set, lease) end\n\
             end\n",
        ),
    ];

    #[test]
    fn every_copy_of_a_helper_is_the_same_text() {
        for (name, text) in HELPERS {
            let definition = format!("local function {name}(");
            for script in ALL {
                if script.contains(&definition) {
                    assert!(script.contains(text), "a script's copy of {name} differs");
                }
            }
        }
    }

    #[test]
    fn every_script_names_its_keys_arguments_and_answers_in_its_header() {
        for script in ALL {
            let header: Vec<&str> = script.lines().take_while(|l| l.starts_with("--")).collect();
            for word in ["-- KEYS[1]", "-- ARGV[1]", "-- Returns"] {
                assert!(
                    header.iter().any(|line| line.starts_with(word)),
                    "a header without {word}: {}",
                    header.first().unwrap_or(&"")
                );
            }
        }
    }
}
