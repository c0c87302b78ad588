//! How an acquire ends when it does not take the lock: the errors callers are told, from the
//! evidence the engine has (see the waiting room's "What a caller that cannot enter is told").

use std::time::Duration;

use tokio::time::Instant;

use super::waiting_room::WaitEvidence;
use crate::backend::{BackendError, BackendErrorKind};
use crate::error::{ErrorKind, LockError};
use crate::health::Refusal;

/// What a caller whose attempt failed is told: the failure, with its cause kept as the source.
/// A transient failure (or "lease gone", which has no meaning before a lease exists) is an
/// outage: `Unavailable`, saying whether the backend answered.
pub(super) fn attempt_error(error: BackendError) -> LockError {
    let what = match error.kind() {
        BackendErrorKind::Transient { reached: true } => {
            "the backend answered the latest attempt with a failure"
        }
        BackendErrorKind::Transient { reached: false } => {
            "the latest attempt could not reach the backend"
        }
        BackendErrorKind::LeaseGone => "the latest attempt lost its connection to the backend",
        _ => return error.into_lock_error(),
    };
    let message = format!("{what} ({})", error.message());
    LockError::new(ErrorKind::Unavailable, message).with_source(error)
}

/// What a `try_acquire` that could not enter is told: busy only on evidence that someone holds
/// the key; the failure of the latest attempt as that failure.
pub(super) fn refusal_error(evidence: WaitEvidence) -> LockError {
    match evidence {
        WaitEvidence::Contended => LockError::busy(),
        WaitEvidence::Failing(cause) => attempt_error(cause),
        WaitEvidence::Unanswered => LockError::new(
            ErrorKind::Unavailable,
            "the backend did not answer the attempt in flight for this key",
        ),
    }
}

/// What a caller is told when its attempt is not sent because the backend is failing.
pub(super) fn failing_error(refusal: Refusal) -> LockError {
    let now = Instant::now();
    let failing_for = now.saturating_duration_since(refusal.since);
    let asked_in = refusal.retry_at.saturating_duration_since(now);
    let error = attempt_error(refusal.cause);
    let message = format!(
        "{} (not sent: the backend has been failing for {failing_for:?}, and is asked again in \
         {asked_in:?})",
        error.message()
    );
    error.with_message(message)
}

/// How a queued waiter's wait ends at its deadline, from what it knows about the key.
pub(super) fn wait_error(evidence: WaitEvidence, timeout: Duration) -> LockError {
    match evidence {
        WaitEvidence::Contended => LockError::timed_out(timeout),
        WaitEvidence::Failing(cause) if cause.is_transient() => {
            let what = if cause.reached() {
                "the backend answered the latest attempt for this key with a failure"
            } else {
                "the latest attempt for this key could not reach the backend"
            };
            let message = format!(
                "{what} ({}), and the timeout of {timeout:?} ran out",
                cause.message()
            );
            LockError::new(ErrorKind::Unavailable, message).with_source(cause)
        }
        WaitEvidence::Failing(cause) => attempt_error(cause),
        WaitEvidence::Unanswered => LockError::new(
            ErrorKind::Unavailable,
            format!("no attempt for this key was answered within the timeout of {timeout:?}"),
        ),
    }
}

/// What a caller of an engine that was shut down is told.
pub(super) fn shut_down_error() -> LockError {
    LockError::new(ErrorKind::Unavailable, "the lock provider was shut down")
}

/// The cause the outage gate records for a release left unanswered for the engine's
/// `patience`.
pub(super) fn unanswered_release(patience: Duration) -> BackendError {
    BackendError::unreachable(format!(
        "the backend did not answer a release within {patience:?}"
    ))
}

/// What an attempt left unanswered for the engine's `patience` means: the cause the outage gate
/// records, and what its caller is told.
pub(super) fn unanswered(patience: Duration) -> (BackendError, LockError) {
    let cause = BackendError::unreachable(format!(
        "the backend did not answer an attempt within {patience:?}"
    ));
    let error = LockError::new(ErrorKind::Unavailable, cause.message().to_owned());
    (cause, error)
}
