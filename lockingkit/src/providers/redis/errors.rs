//! What Redis failures mean for a lock.
//!
//! Messages name the stage and the failure's kind or server error code, never the server's
//! own text (a script error may quote arguments) and never a key or the URL.

use std::time::Duration;

use redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::backend::BackendError;

/// What the backend was doing when a request failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    Connect,
    Check,
    Attempt,
    Renew,
    Release,
}

impl Stage {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Stage::Connect => "connecting to Redis",
            Stage::Check => "the startup check",
            Stage::Attempt => "the lock attempt",
            Stage::Renew => "the lease renewal",
            Stage::Release => "the release",
        }
    }
}

/// The request got no answer within the timeout: the server may be frozen or unreachable.
pub(super) fn timed_out(stage: Stage, timeout: Duration) -> BackendError {
    BackendError::unreachable(format!(
        "{}: Redis did not answer within {timeout:?}",
        stage.as_str()
    ))
}

/// The library's own text for errors it raises itself (bad configuration, parse failures),
/// which are fixed strings; for anything the server said, only its category.
pub(super) fn library_text(error: &RedisError) -> String {
    match error.kind() {
        ErrorKind::InvalidClientConfig | ErrorKind::Client => error.to_string(),
        _ => error.category().to_owned(),
    }
}

/// Classifies a failed request.
///
/// - No answer (refused, reset, dropped, timed out): transient, unreached.
/// - The server is busy, loading, failing over, read-only, out of memory or short of
///   replicas: transient, reached (a waiter retries; a renewal retries until its deadline).
/// - Authentication or permissions refused, a misconfigured server: misconfigured.
/// - Anything else (a script error, an answer of the wrong type): permanent.
pub(super) fn request_error(error: &RedisError, stage: Stage) -> BackendError {
    let what = stage.as_str();
    if error.is_io_error() || error.is_connection_dropped() || error.is_timeout() {
        return BackendError::unreachable(format!(
            "{what}: Redis could not be reached ({})",
            io_kind(error)
        ));
    }
    let code = error.code().unwrap_or("");
    match error.kind() {
        ErrorKind::AuthenticationFailed => {
            BackendError::misconfigured(format!("{what}: Redis refused the credentials in the URL"))
        }
        _ if is_no_permission(error) => BackendError::misconfigured(format!(
            "{what}: the Redis user may not run the lock's commands (NOPERM); it needs EVAL, \
             EVALSHA, SCRIPT LOAD, the commands the scripts run, WAIT when replicas are asked \
             for, PUBLISH, SUBSCRIBE, the prefix's keys `~<key_prefix>:*` and channels \
             `&<key_prefix>:*`"
        )),
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly
            | ServerErrorKind::Moved
            | ServerErrorKind::Ask,
        ) => BackendError::transient(format!("{what}: Redis answered {code}; retrying")),
        ErrorKind::ClusterConnectionNotFound => BackendError::unreachable(format!(
            "{what}: no Redis Cluster node serving the key could be reached"
        )),
        ErrorKind::Extension => match code {
            "BUSY" | "OOM" | "NOREPLICAS" | "MISCONF" | "LOADING" => {
                BackendError::transient(format!("{what}: Redis answered {code}; retrying"))
            }
            "NOAUTH" | "WRONGPASS" => BackendError::misconfigured(format!(
                "{what}: Redis refused the credentials in the URL ({code})"
            )),
            "FENCING" => BackendError::permanent(format!(
                "{what}: the key's fencing counter is at 2^53 - 1, beyond which tokens are not \
                 exact; it was set so by someone else (the clock reaches it in the year 2255)"
            )),
            "WRONGTYPE" => BackendError::permanent(format!(
                "{what}: a key the lock uses holds a value of another type, written by someone \
                 else under the lock's prefix"
            )),
            _ => BackendError::permanent(format!("{what}: Redis answered {code}")),
        },
        _ => BackendError::permanent(format!("{what}: {}", error.category())),
    }
}

fn io_kind(error: &RedisError) -> String {
    if error.is_connection_refusal() {
        "connection refused".to_owned()
    } else if error.is_timeout() {
        "timed out".to_owned()
    } else if error.is_connection_dropped() {
        "connection closed".to_owned()
    } else {
        error.category().to_owned()
    }
}

/// Whether `error` says Redis refused our credentials (or forgot them): only a new connection
/// can authenticate again.
pub(super) fn is_authentication(error: &RedisError) -> bool {
    error.kind() == ErrorKind::AuthenticationFailed
        || matches!(error.code(), Some("NOAUTH" | "WRONGPASS"))
}

/// Whether `error` says the user may not run a command or use a key or channel: `NOPERM`, or
/// the `ERR` a script gets when a command it runs is refused to its user ("The user executing
/// the script can't run this command…", "…can't publish to the channel…").
pub(super) fn is_no_permission(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoPerm)
        || (error.code() == Some("ERR")
            && error
                .detail()
                .is_some_and(|detail| detail.starts_with("The user executing the script can't")))
}

/// Whether `error` says the server lacks a script we sent by SHA (after a restart, a failover,
/// `SCRIPT FLUSH`), so it must be loaded and sent again.
pub(super) fn is_missing_script(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
}

/// Whether `error` says a key holds a value of another type: someone else wrote there.
pub(super) fn is_wrong_type(error: &RedisError) -> bool {
    error.code() == Some("WRONGTYPE")
}
