//! The startup check ([`RedisBackend::verify`](super::RedisBackend::verify)): what building a
//! backend cannot know, asked of the server on connections of the check's own, which it closes.
//!
//! 1. Connecting and authenticating, and loading the lock scripts (on a cluster, into every
//!    primary): the user may run them.
//! 2. `PUBLISH` and `SUBSCRIBE` on a channel under the prefix that no lock uses: the release
//!    scripts publish (best effort: a refused publish does not fail a release, but wakes no
//!    waiter), and the release watch subscribes. A Redis 7 ACL user has no channels unless
//!    granted some, so this is the permission most often missing.
//! 3. `CONFIG GET maxmemory-policy`, where the user may: a policy that evicts keys can delete a
//!    held lock, so anything but `noeviction` is logged as a warning (not a failure: a dedicated
//!    instance whose memory never fills is safe with any policy).

use std::time::Duration;

use redis::Value;

use super::connection::{Connection, Request};
use super::errors::{self, Stage};
use super::eval::Scripts;
use super::keys::RedisLockKeys;
use super::watch;
use crate::backend::BackendError;

/// Runs the check. `prefix` is the backend's key prefix.
pub(super) async fn run(
    connection: &Connection,
    scripts: &Scripts,
    prefix: &str,
    timeout: Duration,
) -> Result<(), BackendError> {
    let mut checking = connection.check_link().await?;
    for script in scripts.all() {
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(script.source());
        checking
            .send(Request::Command(&load))
            .await?
            .map_err(|error| errors::request_error(&error, Stage::Check))?;
    }
    // The empty key is no lock key (keys have 1 to 512 characters), so no waiter listens here.
    let channel = RedisLockKeys::lock(prefix, "").released;
    let mut publish = redis::cmd("PUBLISH");
    publish.arg(&channel).arg("check");
    checking
        .send(Request::Command(&publish))
        .await?
        .map_err(|error| channel_error(&error, "publish on", prefix))?;
    subscribe(connection, &channel, prefix, timeout).await?;
    let mut policy = redis::cmd("CONFIG");
    policy.arg("GET").arg("maxmemory-policy");
    match checking.send(Request::Command(&policy)).await? {
        Ok(answer) => warn_if_evicting(&answer),
        Err(_) => tracing::info!(
            target: "lockingkit",
            provider = super::PROVIDER,
            "the Redis startup check could not read maxmemory-policy (CONFIG GET is refused); \
             locks need `noeviction`, or an instance whose memory never fills"
        ),
    }
    Ok(())
}

/// Subscribes to `channel` on a pub/sub connection of its own, which is closed at once.
async fn subscribe(
    connection: &Connection,
    channel: &str,
    prefix: &str,
    timeout: Duration,
) -> Result<(), BackendError> {
    let (mut sink, _stream) = watch::open(connection.target(), timeout).await?;
    match tokio::time::timeout(timeout, sink.subscribe(channel)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(channel_error(&error, "subscribe to", prefix)),
        Err(_) => Err(errors::timed_out(Stage::Check, timeout)),
    }
}

/// A refused `PUBLISH` or `SUBSCRIBE`, told with what the user lacks.
fn channel_error(error: &redis::RedisError, what: &str, prefix: &str) -> BackendError {
    if !errors::is_no_permission(error) {
        return errors::request_error(error, Stage::Check);
    }
    let channels = RedisLockKeys::hash_tag(prefix);
    BackendError::misconfigured(format!(
        "{}: the Redis user may not {what} the lock's release channels (NOPERM); grant it \
         PUBLISH, SUBSCRIBE and the channels `&{channels}:*` (Redis 7 ACL users have no \
         channels unless granted), or waiters in other processes are not woken by releases",
        Stage::Check.as_str()
    ))
}

/// Logs a warning when the eviction policy in `answer` (`CONFIG GET`'s) may delete locks.
fn warn_if_evicting(answer: &[Value]) {
    let policy = match answer.first() {
        Some(Value::Array(pair)) => pair.get(1),
        Some(Value::Map(pairs)) => pairs.first().map(|(_, value)| value),
        _ => None,
    };
    let policy = match policy {
        Some(Value::BulkString(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
        Some(Value::SimpleString(text)) => text.clone(),
        _ => return,
    };
    if policy != "noeviction" {
        tracing::warn!(
            target: "lockingkit",
            provider = super::PROVIDER,
            policy = %policy,
            "Redis evicts keys when its memory is full (maxmemory-policy {policy}): a held \
             lock can be deleted and taken by another process before its holder notices. Set \
             maxmemory-policy noeviction, or keep locks on an instance whose memory never fills"
        );
    }
}
