//! Running the lock protocol's scripts (see [`lua`](super::lua)): by SHA — each connection
//! loads a script before it first runs it (see `node`) — and followed by `WAIT` in the same
//! round trip when replicas must acknowledge.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Value;

use super::connection::{Connection, Failed, Request};
use super::errors::{self, Stage};
use super::lua::{
    ACQUIRE, ACQUIRE_SHARED, ACQUIRE_SLOT, RELEASE, RELEASE_MEMBER, RENEW, RENEW_MEMBER,
};
use crate::backend::BackendError;

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

/// How many scripts the protocol has.
pub(super) const SCRIPT_COUNT: usize = 7;

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

/// The protocol's scripts with their SHA-1s, computed once: constants, shared by every
/// backend and by every node connection, which the cluster client opens without a way to hand
/// them anything of ours (see `node`).
static PROTOCOL: LazyLock<Scripts> = LazyLock::new(Scripts::new);

impl Scripts {
    /// The protocol's scripts.
    pub(super) fn protocol() -> &'static Scripts {
        &PROTOCOL
    }

    fn new() -> Self {
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
    pub(super) fn all(&self) -> [&Script; SCRIPT_COUNT] {
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

    /// Where the script whose SHA-1 (in hex) is `sha` is in [`all`](Self::all), if it is one
    /// of the protocol's.
    pub(super) fn position(&self, sha: &[u8]) -> Option<usize> {
        self.all()
            .iter()
            .position(|script| script.sha.as_bytes().eq_ignore_ascii_case(sha))
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

/// Runs `script` with `keys` and `args` in one round trip (plus one on the first use of the
/// script on a connection, which loads it), followed by `WAIT` in the same pipeline when
/// `replication` asks for it.
///
/// A server that answers `NOSCRIPT` lost its script cache under the connection, which then
/// loads the script again before sending the request once more; only a cache emptied again in
/// between has the script sent whole.
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
) -> Result<Answer, Failed> {
    let by_sha = invocation("EVALSHA", &script.sha, keys, args);
    let mut answered = send(connection, stage, by_sha.clone(), replication).await?;
    if answered.as_ref().is_err_and(errors::is_missing_script) {
        answered = send(connection, stage, by_sha, replication).await?;
    }
    if answered.as_ref().is_err_and(errors::is_missing_script) {
        let whole = invocation("EVAL", script.source, keys, args);
        answered = send(connection, stage, whole, replication).await?;
    }
    answer_of(answered, stage, replication).map_err(Failed::sent)
}

/// What the script's answer (and `WAIT`'s) says, or the failure the server answered.
fn answer_of(
    answered: redis::RedisResult<Vec<Value>>,
    stage: Stage,
    replication: Option<Replication>,
) -> Result<Answer, BackendError> {
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
) -> Result<redis::RedisResult<Vec<Value>>, Failed> {
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
