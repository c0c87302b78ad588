//! The lock protocol: one Lua script per step, each touching the keys of one hash slot (see
//! [`RedisLockKeys`](crate::keys::RedisLockKeys)), so every step is one round trip and works
//! on Redis Cluster.
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
//! Tokens fit JavaScript's and Lua's doubles exactly until the year 2255.

use std::time::Duration;

use redis::Value;

use super::connection::{Connection, Request};
use super::errors::{self, Stage};
use crate::backend::BackendError;

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

/// KEYS: lock, readers, intent, fence. ARGV: holder id, lease ms, intent ms.
/// The token, or 0 when a holder or a live reader is there (a reader: the intent is set).
const ACQUIRE: &str = with_helpers!(
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

/// KEYS: lock, readers, intent, fence. ARGV: holder id, lease ms.
/// The token, or 0 while a writer holds the key or waits for it.
const ACQUIRE_SHARED: &str = with_helpers!(
    "if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local t = redis.call('TIME')
local now = now_ms(t)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local token = mint(KEYS[4], t)
hold(KEYS[2], ARGV[1], now + tonumber(ARGV[2]), ARGV[2])
return token"
);

/// KEYS: holders, fence. ARGV: holder id, lease ms, max count.
/// The token, or 0 when `max count` live holders are there.
const ACQUIRE_SLOT: &str = with_helpers!(
    "local t = redis.call('TIME')
local now = now_ms(t)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
local token = mint(KEYS[2], t)
hold(KEYS[1], ARGV[1], now + tonumber(ARGV[2]), ARGV[2])
return token"
);

/// KEYS: lock. ARGV: holder id, lease ms. 1 when extended, 0 when the key is not ours.
const RENEW: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0";

/// KEYS: readers or holders. ARGV: holder id, lease ms. 1 when extended, 0 when the member is
/// gone or expired.
const RENEW_MEMBER: &str = with_helpers!(
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

/// KEYS: lock. ARGV: holder id, channel. 1 when deleted (and published), 0 when not ours.
const RELEASE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'released')
  return 1
end
return 0";

/// KEYS: readers or holders. ARGV: holder id, channel (empty: publish nothing).
/// 1 when a live member was removed, 0 when it was gone or had expired.
const RELEASE_MEMBER: &str = "local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.call('PUBLISH', ARGV[2], 'released') end
local t = redis.call('TIME')
if tonumber(score) <= tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then return 0 end
return 1";

/// One script: its source, and its SHA-1 under which the server caches it.
pub(super) struct Script {
    source: &'static str,
    sha: String,
}

impl Script {
    fn new(source: &'static str) -> Self {
        Script {
            source,
            sha: redis::Script::new(source).get_hash().to_owned(),
        }
    }

    /// The Lua source, as the server runs it.
    pub(super) fn source(&self) -> &'static str {
        self.source
    }
}

/// Every script of the protocol.
pub(super) struct Scripts {
    pub(super) acquire: Script,
    pub(super) acquire_shared: Script,
    pub(super) acquire_slot: Script,
    pub(super) renew: Script,
    pub(super) renew_member: Script,
    pub(super) release: Script,
    pub(super) release_member: Script,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Scripts {
            acquire: Script::new(ACQUIRE),
            acquire_shared: Script::new(ACQUIRE_SHARED),
            acquire_slot: Script::new(ACQUIRE_SLOT),
            renew: Script::new(RENEW),
            renew_member: Script::new(RENEW_MEMBER),
            release: Script::new(RELEASE),
            release_member: Script::new(RELEASE_MEMBER),
        }
    }

    /// Every script, for loading them all at once.
    pub(super) fn all(&self) -> [&Script; 7] {
        [
            &self.acquire,
            &self.acquire_shared,
            &self.acquire_slot,
            &self.renew,
            &self.renew_member,
            &self.release,
            &self.release_member,
        ]
    }
}

/// Waiting for replicas after a write: `WAIT replicas timeout`, in the same round trip.
#[derive(Clone, Copy, Debug)]
pub(super) struct Replication {
    pub(super) replicas: u32,
    pub(super) timeout: Duration,
}

/// What a script answered, and how many replicas acknowledged it when that was asked.
#[derive(Clone, Copy, Debug)]
pub(super) struct Answer {
    pub(super) value: i64,
    pub(super) acknowledged: Option<i64>,
}

/// Runs `script` with `keys` and `args` in one round trip (two only when the server does not
/// have the script cached yet: it is then sent whole, which caches it), followed by `WAIT` in
/// the same pipeline when `replication` asks for it.
///
/// A key that holds a value of another type means someone else wrote under the lock's names:
/// for a renewal or release that is the lease gone; for an attempt, a permanent failure.
pub(super) async fn run(
    connection: &Connection,
    stage: Stage,
    script: &Script,
    keys: &[&str],
    args: &[&str],
    replication: Option<Replication>,
) -> Result<Answer, BackendError> {
    let by_sha = invocation("EVALSHA", &script.sha, keys, args);
    let mut answered = send(connection, stage, by_sha, replication).await?;
    if answered.as_ref().is_err_and(errors::is_missing_script) {
        let whole = invocation("EVAL", script.source, keys, args);
        answered = send(connection, stage, whole, replication).await?;
    }
    let values = match answered {
        Ok(values) => values,
        Err(error) if errors::is_wrong_type(&error) && stage != Stage::Attempt => {
            return Err(BackendError::lease_gone(
                "a key of the lock was overwritten with a value of another type",
            ))
        }
        Err(error) => return Err(errors::request_error(&error, stage)),
    };
    let mut values = values.into_iter();
    let value = integer(values.next(), stage)?;
    let acknowledged = match replication {
        Some(_) => Some(integer(values.next(), stage)?),
        None => None,
    };
    Ok(Answer {
        value,
        acknowledged,
    })
}

fn invocation(command: &str, script: &str, keys: &[&str], args: &[&str]) -> redis::Cmd {
    let mut cmd = redis::cmd(command);
    cmd.arg(script).arg(keys.len()).arg(keys).arg(args);
    cmd
}

async fn send(
    connection: &Connection,
    stage: Stage,
    cmd: redis::Cmd,
    replication: Option<Replication>,
) -> Result<redis::RedisResult<Vec<Value>>, BackendError> {
    match replication {
        None => connection.send(stage, Request::Command(&cmd)).await,
        Some(Replication { replicas, timeout }) => {
            let mut pipeline = redis::pipe();
            pipeline
                .add_command(cmd)
                .cmd("WAIT")
                .arg(replicas)
                .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
            connection
                .send(stage, Request::Pipeline(&pipeline, 2))
                .await
        }
    }
}

fn integer(value: Option<Value>, stage: Stage) -> Result<i64, BackendError> {
    match value {
        Some(Value::Int(value)) => Ok(value),
        _ => Err(BackendError::permanent(format!(
            "{}: Redis answered the lock script with something other than an integer",
            stage.as_str()
        ))),
    }
}
