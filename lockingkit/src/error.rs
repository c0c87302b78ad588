//! The one error type every LockingKit operation returns.

use std::fmt;

use crate::telemetry::LossReason;

/// What went wrong, in terms a caller can act on.
///
/// Each kind has a stable string code (see [`ErrorKind::code`]) that is safe to put in logs,
/// metrics and HTTP problem documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Someone else holds the lock, including another caller in this process.
    Busy,
    /// The caller waited the whole timeout; the backend answered, and the lock stayed busy.
    Timeout,
    /// The backend could not be reached, or answered with a failure of its own (a 5xx, a full
    /// lock table), so nothing is known about the lock.
    Unavailable,
    /// The handle no longer holds the lock.
    Lost,
    /// The key is empty or longer than 512 characters.
    InvalidKey,
    /// The options are wrong, or the backend refused our credentials or lacks a resource.
    Misconfigured,
    /// The backend failed in a way that no retry can fix.
    Backend,
}

impl ErrorKind {
    /// The stable code of this kind, such as `locking.busy`.
    pub const fn code(self) -> &'static str {
        match self {
            ErrorKind::Busy => "locking.busy",
            ErrorKind::Timeout => "locking.timeout",
            ErrorKind::Unavailable => "locking.unavailable",
            ErrorKind::Lost => "locking.lost",
            ErrorKind::InvalidKey => "locking.invalid_key",
            ErrorKind::Misconfigured => "locking.misconfigured",
            ErrorKind::Backend => "locking.backend",
        }
    }

    /// The short name used as the `lockingkit.error.kind` telemetry attribute.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Busy => "busy",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Lost => "lost",
            ErrorKind::InvalidKey => "invalid_key",
            ErrorKind::Misconfigured => "misconfigured",
            ErrorKind::Backend => "backend",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

/// A cause, shared: errors are cloned where one failure answers several callers (a backend
/// that is failing refuses every caller with the same cause).
pub(crate) type SharedSource = std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>;

/// The error of every fallible LockingKit operation.
///
/// A `LockError` carries an [`ErrorKind`], a human-readable message and, where one exists, the
/// backend error that caused it. Messages never contain the lock key or any secret: keys
/// routinely carry customer ids, and connection strings carry passwords. Cloning is cheap: the
/// cause is shared.
#[derive(Clone)]
pub struct LockError {
    kind: ErrorKind,
    message: String,
    source: Option<SharedSource>,
}

impl LockError {
    /// Creates an error of `kind` with a message for humans.
    ///
    /// The message must not contain keys or secrets; LockingKit's own messages never do.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        LockError {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the underlying cause, reachable through [`std::error::Error::source`].
    pub fn with_source(
        self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        self.with_shared_source(SharedSource::from(source.into()))
    }

    /// The same error with another message (the kind and cause stay).
    pub(crate) fn with_message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    /// Attaches a cause that other errors share.
    pub(crate) fn with_shared_source(mut self, source: SharedSource) -> Self {
        self.source = Some(source);
        self
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The stable code of the kind, such as `locking.busy`.
    pub fn code(&self) -> &'static str {
        self.kind.code()
    }

    /// The message without the code.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Returns `true` for [`ErrorKind::Busy`] and [`ErrorKind::Timeout`]: contention, not failure.
    pub fn is_contention(&self) -> bool {
        matches!(self.kind, ErrorKind::Busy | ErrorKind::Timeout)
    }

    /// The [`ErrorKind::Busy`] error: someone else holds the lock.
    pub(crate) fn busy() -> Self {
        LockError::new(ErrorKind::Busy, "the lock is held by someone else")
    }

    /// The [`ErrorKind::Timeout`] error: the backend answered "busy" until the wait of
    /// `timeout` ended. The engine's waits and the transaction-scoped locks' end this way.
    pub(crate) fn timed_out(timeout: std::time::Duration) -> Self {
        LockError::new(
            ErrorKind::Timeout,
            format!("the lock stayed busy for the whole timeout of {timeout:?}"),
        )
    }

    /// The [`ErrorKind::Lost`] error every layer reports once a lock is gone: `reason` says why
    /// it was lost, or is `None` when it was released (or the reason is not known).
    pub fn lost(reason: Option<LossReason>) -> Self {
        match reason {
            Some(reason) => LockError::new(
                ErrorKind::Lost,
                format!("the lock was lost ({})", reason.as_str()),
            ),
            None => LockError::new(ErrorKind::Lost, "the lock is no longer held"),
        }
    }

    /// The one [`ErrorKind::Misconfigured`] error that lists every problem found, each naming
    /// the setting it is about (`Locking.Default.lease_duration: …`).
    pub fn misconfigured<P: fmt::Display>(problems: impl IntoIterator<Item = P>) -> Self {
        let listed: Vec<String> = problems.into_iter().map(|p| p.to_string()).collect();
        LockError::new(
            ErrorKind::Misconfigured,
            format!("invalid lock configuration: {}", listed.join("; ")),
        )
    }

    /// The `error.type` telemetry attribute: the kind's stable code. Not the source error's
    /// Rust type name, which would change with our dependencies and can name internals.
    pub(crate) fn error_type(&self) -> &'static str {
        self.kind.code()
    }
}

impl fmt::Debug for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("LockError");
        s.field("kind", &self.kind).field("message", &self.message);
        if let Some(source) = &self.source {
            s.field("source", &format_args!("{source}"));
        }
        s.finish()
    }
}

impl fmt::Display for LockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.code(), self.message)
    }
}

impl std::error::Error for LockError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_starts_with_the_code() {
        let err = LockError::new(ErrorKind::Timeout, "waited 5s");
        assert_eq!(err.to_string(), "locking.timeout: waited 5s");
        assert_eq!(err.code(), "locking.timeout");
        assert!(err.is_contention());
    }

    #[test]
    fn every_kind_has_a_distinct_code() {
        let kinds = [
            ErrorKind::Busy,
            ErrorKind::Timeout,
            ErrorKind::Unavailable,
            ErrorKind::Lost,
            ErrorKind::InvalidKey,
            ErrorKind::Misconfigured,
            ErrorKind::Backend,
        ];
        let codes: std::collections::HashSet<_> = kinds.iter().map(|k| k.code()).collect();
        assert_eq!(codes.len(), kinds.len());
        assert!(codes.iter().all(|c| c.starts_with("locking.")));
    }

    #[test]
    fn lock_error_is_send_sync_and_static() {
        fn assert_bounds<T: Send + Sync + 'static + std::error::Error>() {}
        assert_bounds::<LockError>();
    }
}
