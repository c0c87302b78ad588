//! How an acquire ends when it does not take the lock: the errors callers are told, from the
//! evidence the engine has (see the waiting room's "What a caller that cannot enter is told").

use std::time::Duration;

use tokio::time::Instant;

use super::waiting_room::{Answer, WaitEvidence};
use crate::backend::{BackendError, BackendErrorKind};
use crate::error::{ErrorKind, LockError};
use crate::health::Refusal;

pub(super) fn attempt_error(error: BackendError) -> LockError {
    match error.kind() {
        // "Lease gone" has no meaning before a lease exists; treat it as the transient
        // failure it is.
        BackendErrorKind::LeaseGone => {
            LockError::new(ErrorKind::Unavailable, error.message().to_owned()).with_source(error)
        }
        _ => error.into_lock_error(),
    }
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

fn unreachable_error(timeout: Duration) -> LockError {
    LockError::new(
        ErrorKind::Unavailable,
        format!("no attempt reached the backend within the timeout of {timeout:?}"),
    )
}

/// What the latest finished attempt of a wait found.
pub(super) enum Latest {
    /// No attempt has finished yet.
    NoAnswer,
    /// The backend answered "busy".
    Busy,
    /// The attempt failed: the backend reported a failure itself (a 5xx, a full lock table), or
    /// could not be reached ([`BackendError::reached`] tells which), or the attempt was not
    /// sent because the backend was failing already.
    Failed(BackendError),
}

impl Latest {
    /// The answer this stands for, for callers that meet the key.
    pub(super) fn answer(&self) -> Answer {
        match self {
            // Only noted after an attempt finished; "busy" is the answer that claims least.
            Latest::NoAnswer | Latest::Busy => Answer::Busy,
            Latest::Failed(cause) => Answer::Failed(cause.clone()),
        }
    }

    /// What a failed attempt found; a failure no retry can fix ends the wait with its error.
    pub(super) fn after_failure(error: BackendError) -> Result<Latest, LockError> {
        if error.is_transient() {
            Ok(Latest::Failed(error))
        } else {
            Err(attempt_error(error))
        }
    }
}

/// How a wait that ran out of time ends: `Timeout` only if the backend was answering "busy" at
/// the end; `Unavailable` (with the latest cause) if the latest attempt failed, whether the
/// backend reported the failure or could not be reached.
///
/// The latest *finished* attempt decides, except that an attempt still unanswered at the
/// deadline after `patience` (the longest the engine sleeps between attempts: a backend that
/// answers takes far less) counts as not reaching the backend, so an outage that hangs
/// requests after a busy answer is not reported as contention either.
pub(super) fn wait_outcome(
    timeout: Duration,
    latest: Latest,
    in_flight: Option<Instant>,
    patience: Duration,
) -> LockError {
    if let Some(sent) = in_flight {
        let unanswered = sent.elapsed();
        if unanswered >= patience {
            return LockError::new(
                ErrorKind::Unavailable,
                format!(
                    "the backend did not answer the latest attempt within {unanswered:?}, and the timeout of {timeout:?} ran out"
                ),
            );
        }
    }
    match latest {
        Latest::Busy => LockError::timed_out(timeout),
        Latest::Failed(cause) if cause.reached() => LockError::new(
            ErrorKind::Unavailable,
            format!(
                "the backend answered the latest attempt with a failure ({}), and the timeout of {timeout:?} ran out",
                cause.message()
            ),
        )
        .with_source(cause),
        Latest::NoAnswer => unreachable_error(timeout),
        Latest::Failed(cause) => LockError::new(
            ErrorKind::Unavailable,
            format!(
                "the latest attempt could not reach the backend ({}), and the timeout of {timeout:?} ran out",
                cause.message()
            ),
        )
        .with_source(cause),
    }
}
