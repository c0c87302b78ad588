//! The lock protocol: one Lua script per step, each touching the keys of one hash slot (see
//! [`RedisLockKeys`](crate::keys::RedisLockKeys)), so every step is one round trip and works
//! on Redis Cluster. The sources are public so another program can take the very same locks:
//! run them with `EVAL` (or `EVALSHA`) with the keys and arguments each one names.
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

/// Helpers every acquiring script starts with: the clock in milliseconds, minting a token, and
/// holding a member of a sorted set until a time, with the set kept alive as long as its
/// longest-lived member.
macro_rules! with_helpers {
    ($body:expr) => {
        concat!(
            "local function now_ms(t) return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) end\n",
            "local function mint(fence, t)\n",
            "  local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])\n",
            "  local last = tonumber(redis.call('GET', fence) or '0') or 0\n",
            "  if last >= 9007199254740991 then\n",
            "    error(redis.error_reply('FENCING the fencing counter is at 2^53-1: no greater token is exact'))\n",
            "  end\n",
            "  local token = math.max(last + 1, floor)\n",
            "  redis.call('SET', fence, string.format('%d', token), 'PX', 86400000)\n",
            "  return token\n",
            "end\n",
            "local function hold(set, member, until_ms, lease)\n",
            "  redis.call('ZADD', set, until_ms, member)\n",
            "  if redis.call('PTTL', set) < tonumber(lease) then redis.call('PEXPIRE', set, lease) end\n",
            "end\n",
            $body
        )
    };
}

/// Takes the lock exclusively (a writer, or a plain lock).
///
/// KEYS: `lock`, `readers`, `intent`, `fence` of [`RedisLockKeys::lock`]. ARGV: a holder id (any
/// string unique to this hold), the lease in milliseconds, the writer's intent in milliseconds.
/// Answers the fencing token, or 0 when the lock is held or read; finding live readers, it sets
/// the intent, which refuses new readers until it expires or a writer takes the lock.
///
/// [`RedisLockKeys::lock`]: crate::keys::RedisLockKeys::lock
pub const ACQUIRE: &str = with_helpers!(
    "if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = redis.call('TIME')
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now_ms(t))
  if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('SET', KEYS[3], '1', 'PX', ARGV[3])
    return 0
  end
end
local token = mint(KEYS[4], t)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[3])
return token"
);

/// Takes the lock shared (a reader).
///
/// KEYS as [`ACQUIRE`]. ARGV: a holder id, the lease in milliseconds. Answers the fencing token,
/// or 0 while a writer holds the lock or its intent stands. The reader is a member of `readers`
/// scored by its expiry (Unix ms).
pub const ACQUIRE_SHARED: &str = with_helpers!(
    "if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local t = redis.call('TIME')
local now = now_ms(t)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local token = mint(KEYS[4], t)
hold(KEYS[2], ARGV[1], now + tonumber(ARGV[2]), ARGV[2])
return token"
);

/// Takes a place in a semaphore.
///
/// KEYS: `holders`, `fence` of [`RedisLockKeys::semaphore`]. ARGV: a holder id, the lease in
/// milliseconds, the semaphore's count. Answers the fencing token, or 0 when `count` live holders
/// are there. Every process must give the semaphore the same count.
///
/// [`RedisLockKeys::semaphore`]: crate::keys::RedisLockKeys::semaphore
pub const ACQUIRE_SLOT: &str = with_helpers!(
    "local t = redis.call('TIME')
local now = now_ms(t)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
local token = mint(KEYS[2], t)
hold(KEYS[1], ARGV[1], now + tonumber(ARGV[2]), ARGV[2])
return token"
);

/// Renews an exclusive hold: KEYS `lock`; ARGV the holder id, the lease in milliseconds.
/// Answers 1 when extended, 0 when the lock is gone or another holder's.
pub const RENEW: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0";

/// Renews a reader or a semaphore holder: KEYS `readers` or `holders`; ARGV the holder id, the
/// lease in milliseconds. Answers 1 when extended, 0 when the member is gone or expired.
pub const RENEW_MEMBER: &str = with_helpers!(
    "local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return 0 end
local t = redis.call('TIME')
local now = now_ms(t)
if tonumber(score) <= now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
hold(KEYS[1], ARGV[1], now + tonumber(ARGV[2]), ARGV[2])
return 1"
);

/// Releases an exclusive hold and publishes `released` on the channel, waking waiters: KEYS
/// `lock`; ARGV the holder id, the `released` channel. Answers 1 when deleted, 0 when the lock
/// was gone or another holder's (then nothing is deleted or published). Publishing is best
/// effort (`redis.pcall`): a user that may not publish on the channel still releases.
pub const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.pcall('PUBLISH', ARGV[2], 'released')
  return 1
end
return 0";

/// Releases a reader or a semaphore holder: KEYS `readers` or `holders`; ARGV the holder id and
/// the channel to publish on (readers: `released`; empty for a semaphore, which publishes
/// nothing; publishing is best effort, as in [`RELEASE`]). Answers 1 when a live member was
/// removed, 0 when it was gone or had expired.
pub const RELEASE_MEMBER: &str = "local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.pcall('PUBLISH', ARGV[2], 'released') end
local t = redis.call('TIME')
if tonumber(score) <= tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then return 0 end
return 1";
