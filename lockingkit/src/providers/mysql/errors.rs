//! What a MySQL or MariaDB failure means for a lock.
//!
//! The server's error number tells a refused password from a server shutting down. Messages
//! name the error number and the server's own words (which name the user or the database,
//! never a key or a password); lock names never appear in them.

use std::time::Duration;

use crate::backend::BackendError;

/// Where a failure happened: the same error means different things on a session that holds a
/// lock (the lock is gone) and on one that is only being set up (the server is unreachable).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Opening a session.
    Connect,
    /// A statement that takes a lock (or sets up the fencing table).
    Attempt,
    /// A check of a session that holds locks.
    Held,
    /// The unlock. A failure ends the session (which frees the lock), so the release is
    /// unconfirmed rather than the lock lost.
    Release,
}

/// The server error that says the fencing table is missing.
pub(super) const NO_SUCH_TABLE: u16 = 1146;
/// The server error that says a table of a system schema is unknown (MySQL 8 has no
/// `information_schema.GLOBAL_STATUS`).
const UNKNOWN_TABLE: u16 = 1109;

/// Whether `code` says a table the statement reads does not exist.
pub(super) fn is_unknown_table(code: u16) -> bool {
    code == NO_SUCH_TABLE || code == UNKNOWN_TABLE
}

/// The server error that says a table to create exists already.
pub(super) const TABLE_EXISTS: u16 = 1050;

/// A statement or connection that did not answer within its timeout.
pub(super) fn timed_out(stage: Stage, timeout: Duration) -> BackendError {
    let message = format!("MySQL did not answer within {timeout:?}");
    match stage {
        Stage::Held => BackendError::lease_gone(message),
        Stage::Connect | Stage::Attempt | Stage::Release => BackendError::unreachable(message),
    }
}

/// The session a failure happened on is gone: the server or the network closed it.
pub(super) fn session_gone(stage: Stage, message: String) -> BackendError {
    match stage {
        Stage::Held | Stage::Release => BackendError::lease_gone(message),
        Stage::Connect | Stage::Attempt => BackendError::unreachable(message),
    }
}

/// Whether `error` leaves the connection unusable (its protocol state is unknown or the
/// server closed it): the session holding it must end.
pub(super) fn breaks_session(error: &mysql_async::Error) -> bool {
    match error {
        mysql_async::Error::Server(server) => matches!(server.code, 1053 | 1927 | 2013 | 4031),
        mysql_async::Error::Url(_) => false,
        mysql_async::Error::Driver(_)
        | mysql_async::Error::Io(_)
        | mysql_async::Error::Other(_) => true,
    }
}

/// Classifies a mysql_async error raised at `stage`.
pub(super) fn query_error(error: mysql_async::Error, stage: Stage) -> BackendError {
    let server = match &error {
        mysql_async::Error::Server(server) => server,
        mysql_async::Error::Url(_) => {
            return BackendError::misconfigured("the MySQL connection string is invalid");
        }
        mysql_async::Error::Io(_) | mysql_async::Error::Driver(_) => {
            return session_gone(stage, format!("the MySQL connection failed: {error}"));
        }
        mysql_async::Error::Other(_) => {
            // TLS and name resolution failures surface here.
            return session_gone(stage, format!("the MySQL connection failed: {error}"));
        }
    };
    let code = server.code;
    let words = || format!("MySQL error {code}: {}", server.message);
    match code {
        1044 | 1045 | 1698 => BackendError::misconfigured(format!(
            "MySQL refused the credentials ({})",
            words()
        )),
        1049 => BackendError::misconfigured(format!("the MySQL database does not exist ({})", words())),
        1142 | 1227 | 1370 => BackendError::misconfigured(format!(
            "MySQL denied permission; the user needs SELECT, UPDATE and CREATE on the fencing table, or the table created beforehand ({})",
            words()
        )),
        NO_SUCH_TABLE => BackendError::misconfigured(format!(
            "the MySQL fencing table is missing and could not be created ({})",
            words()
        )),
        1290 | 1836 => BackendError::misconfigured(format!(
            "the MySQL server is read-only (a replica?); connect to the primary ({})",
            words()
        )),
        // Out of connections: the server's or this user's budget.
        1040 | 1203 | 1226 => BackendError::transient(format!(
            "MySQL has no connection slot for us ({})",
            words()
        )),
        // Shutdown, a killed session, a lost connection.
        1053 | 1927 | 2013 | 4031 => session_gone(stage, format!("the MySQL session ended ({})", words())),
        // Lock wait timeout or deadlock on the fencing row, an interrupted or timed-out
        // statement: another try may succeed.
        1205 | 1213 | 1317 | 1969 | 3024 => BackendError::transient(words()),
        _ if stage == Stage::Connect => {
            BackendError::unreachable(format!("MySQL refused the connection ({})", words()))
        }
        _ => BackendError::permanent(words()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendErrorKind;

    fn server(code: u16) -> mysql_async::Error {
        mysql_async::Error::Server(mysql_async::ServerError {
            code,
            message: "words".into(),
            state: "HY000".into(),
        })
    }

    #[test]
    fn credentials_and_permissions_are_misconfiguration() {
        for code in [1044, 1045, 1049, 1142, 1146, 1290] {
            assert_eq!(
                query_error(server(code), Stage::Attempt).kind(),
                BackendErrorKind::Misconfigured,
                "{code}"
            );
        }
    }

    #[test]
    fn an_ended_session_is_loss_for_its_locks_and_an_outage_for_attempts() {
        assert_eq!(
            query_error(server(1927), Stage::Held).kind(),
            BackendErrorKind::LeaseGone
        );
        assert_eq!(
            query_error(server(1053), Stage::Attempt).kind(),
            BackendErrorKind::Transient { reached: false }
        );
        assert!(breaks_session(&server(1927)));
        assert!(!breaks_session(&server(1205)));
    }
}
