//! How etcd's failures map onto [`BackendError`]s. Messages name the operation, never a key or
//! a secret: etcd's own messages quote neither, and gRPC metadata is never shown.

use std::future::Future;
use std::time::Duration;

use etcd_client::Error;
use tonic::Code;

use crate::backend::BackendError;

/// The message etcd answers a request that names a lease it does not have (expired, revoked).
const LEASE_NOT_FOUND: &str = "requested lease not found";

/// Runs one request under the request timeout: a member that stopped answering (a paused
/// process, a silent network) would otherwise hang the call for as long as the connection
/// lives. A request that could not even be sent because its member's connection was refused
/// (a member that is down: the client keeps it among the endpoints it balances over) is sent
/// again at once, to whichever member the client picks next, within the same timeout.
pub(super) async fn bounded<T, F: Future<Output = Result<T, Error>>>(
    what: &'static str,
    timeout: Duration,
    mut request: impl FnMut() -> F,
) -> Result<T, BackendError> {
    let deadline = crate::clock::in_(timeout);
    loop {
        match tokio::time::timeout_at(deadline, request()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(error)) if never_sent(&error) && tokio::time::Instant::now() < deadline => {
                tokio::task::yield_now().await;
            }
            Ok(Err(error)) => return Err(classify(what, error)),
            Err(_) => {
                return Err(BackendError::unreachable(format!(
                    "etcd did not answer the {what} within {timeout:?}"
                )))
            }
        }
    }
}

/// Whether the request failed before it was sent: no connection to its member could be made.
pub(super) fn never_sent(error: &Error) -> bool {
    match error {
        Error::GRpcStatus(status) => {
            status.code() == Code::Unavailable && status.message().contains("connect error")
        }
        Error::TransportError(_) => true,
        _ => false,
    }
}

/// Whether etcd said the lease named by a request is gone.
pub(super) fn is_lease_not_found(error: &Error) -> bool {
    matches!(error, Error::GRpcStatus(status) if status.message().contains(LEASE_NOT_FOUND))
        || matches!(error, Error::LeaseKeepAliveError(message) if message.contains("lease not found"))
}

/// The backend error for a failed request.
pub(super) fn classify(what: &'static str, error: Error) -> BackendError {
    if is_lease_not_found(&error) {
        return BackendError::lease_gone(format!("etcd says the lease is gone ({what})"));
    }
    let classified = match &error {
        Error::GRpcStatus(status) => from_status(what, status),
        Error::TransportError(_) | Error::IoError(_) => {
            BackendError::unreachable(format!("etcd could not be reached for the {what}"))
        }
        Error::InvalidArgs(_) | Error::InvalidUri(_) | Error::EndpointError(_) => {
            BackendError::misconfigured(format!("etcd refused the {what} as invalid"))
        }
        // The watch and keep-alive streams ended under us: the connection went away.
        Error::WatchError(_) | Error::LeaseKeepAliveError(_) => {
            BackendError::unreachable(format!("the etcd stream for the {what} ended"))
        }
        _ => BackendError::permanent(format!("unexpected etcd failure in the {what}")),
    };
    classified.with_source(error)
}

fn from_status(what: &'static str, status: &tonic::Status) -> BackendError {
    // Statuses etcd itself sends carry its `etcdserver:` prefix; tonic makes up the others
    // when it cannot reach a member.
    let from_server = status.message().starts_with("etcdserver:");
    match status.code() {
        Code::Unauthenticated | Code::PermissionDenied => BackendError::misconfigured(format!(
            "etcd refused the {what}: the user lacks permission or the credentials are wrong ({})",
            status.message()
        )),
        Code::InvalidArgument if status.message().contains("authentication failed") => {
            BackendError::misconfigured(format!("etcd refused the credentials for the {what}"))
        }
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::Cancelled
        | Code::Aborted
        | Code::ResourceExhausted
        | Code::Unknown
        | Code::Internal => {
            let message = format!("etcd failed the {what}: {}", status.message());
            if from_server {
                BackendError::transient(message)
            } else {
                BackendError::unreachable(message)
            }
        }
        _ => BackendError::permanent(format!("etcd refused the {what}: {}", status.message())),
    }
}
