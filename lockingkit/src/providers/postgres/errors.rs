//! What a PostgreSQL failure means for a lock.
//!
//! tokio-postgres displays every server error as `db error`; the SQLSTATE is what tells a
//! refused password from a server shutting down. Messages name the SQLSTATE, never the key or
//! the connection string.

use std::time::Duration;

use tokio_postgres::error::SqlState;

use crate::backend::BackendError;

/// Where a failure happened: the same error means different things on a connection that holds
/// a lock (the lock is gone) and on one that is only being set up (the server is unreachable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Opening a session.
    Connect,
    /// A statement on a connection that holds no lock yet.
    Attempt,
    /// A statement on a connection that holds a lock.
    Held,
    /// The unlock. A failure other than a closed session leaves the release unconfirmed (the
    /// connection is closed, which frees the lock), not the lock lost.
    Release,
}

/// A statement or connection that did not answer within its timeout.
pub(super) fn timed_out(stage: Stage, timeout: Duration) -> BackendError {
    let message = format!("PostgreSQL did not answer within {timeout:?}");
    match stage {
        Stage::Held => BackendError::lease_gone(message),
        Stage::Connect | Stage::Attempt | Stage::Release => BackendError::unreachable(message),
    }
}

/// Whether `error` says the fencing objects are missing (dropped after we created them).
pub(super) fn is_missing_object(error: &tokio_postgres::Error) -> bool {
    matches!(
        error.code(),
        Some(c) if *c == SqlState::UNDEFINED_TABLE || *c == SqlState::INVALID_SCHEMA_NAME
    )
}

/// Classifies a tokio-postgres error raised at `stage`.
pub(super) fn query_error(error: tokio_postgres::Error, stage: Stage) -> BackendError {
    let gone = |message: String| match stage {
        Stage::Held | Stage::Release => BackendError::lease_gone(message),
        Stage::Connect | Stage::Attempt => BackendError::unreachable(message),
    };
    if let Some(code) = error.code() {
        let sqlstate = code.code();
        let misconfigured = |what: &str| {
            let failure = BackendError::misconfigured(format!("{what} (SQLSTATE {sqlstate})"));
            // Server messages for these name the role or database, which operators need and
            // which are not secrets; they never contain the key.
            failure.with_source(error_text(&error))
        };
        return match sqlstate {
            "28P01" | "28000" => misconfigured("PostgreSQL refused the credentials"),
            "3D000" => misconfigured("the PostgreSQL database does not exist"),
            "42501" => misconfigured(
                "PostgreSQL denied permission; the role needs CREATE on the database (or the fencing schema and sequence created beforehand) and USAGE, UPDATE on the sequence",
            ),
            "25006" => misconfigured(
                "the PostgreSQL server is read-only (a standby?); connect to the primary, e.g. with target_session_attrs=read-write",
            ),
            // The server's shared lock table is full. Not this session's fault: it stays open.
            "53200" => BackendError::transient(format!(
                "PostgreSQL's lock table is full (SQLSTATE {sqlstate}, out of shared memory); it holds max_locks_per_transaction × (max_connections + max_prepared_transactions) locks for the whole server: raise max_locks_per_transaction (needs a restart) or hold fewer locks"
            )),
            // The session ended: shutdown, crash, or pg_terminate_backend.
            "57P01" | "57P02" | "57P03" => gone(format!(
                "the PostgreSQL session was terminated (SQLSTATE {sqlstate})"
            )),
            _ if sqlstate.starts_with("08") => gone(format!(
                "the PostgreSQL connection failed (SQLSTATE {sqlstate})"
            )),
            _ if stage == Stage::Connect => BackendError::unreachable(format!(
                "PostgreSQL refused the connection (SQLSTATE {sqlstate})"
            )),
            _ if stage == Stage::Held => BackendError::lease_gone(format!(
                "a statement on the lock's connection failed (SQLSTATE {sqlstate})"
            )),
            _ if stage == Stage::Release => BackendError::transient(format!(
                "the unlock failed (SQLSTATE {sqlstate}); it is retried in the background"
            )),
            // Out of resources, serialization or deadlock, lock or statement timeouts, I/O
            // trouble on the server: a later attempt may well succeed.
            _ if ["53", "40", "55", "57", "58"].contains(&&sqlstate[..2.min(sqlstate.len())]) => {
                BackendError::transient(format!(
                    "PostgreSQL failed the statement (SQLSTATE {sqlstate})"
                ))
            }
            _ => BackendError::permanent(format!(
                "PostgreSQL failed the statement (SQLSTATE {sqlstate})"
            )),
        };
    }
    if error.is_closed() {
        return gone("the PostgreSQL connection is closed".to_owned());
    }
    let text = error.to_string();
    if text.starts_with("invalid configuration") || text.starts_with("authentication error") {
        return BackendError::misconfigured(
            "PostgreSQL authentication cannot proceed with these settings",
        )
        .with_source(text);
    }
    if text.starts_with("error performing TLS handshake") && tls_refused(&error) {
        return BackendError::misconfigured(
            "the PostgreSQL TLS handshake was refused; check sslmode and sslrootcert",
        )
        .with_source(text);
    }
    gone(format!("PostgreSQL could not be reached ({text})"))
}

/// Whether a TLS failure is about certificates or support, not a dropped network.
fn tls_refused(error: &tokio_postgres::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    while let Some(cause) = source {
        if cause.is::<rustls::Error>() || cause.to_string().contains("does not support TLS") {
            return true;
        }
        source = cause.source();
    }
    false
}

/// The error with its causes, as one line of text.
fn error_text(error: &tokio_postgres::Error) -> String {
    match error.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => error.to_string(),
    }
}
