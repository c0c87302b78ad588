//! The harness's own errors: what makes a run end with exit code 2.

use std::fmt;

/// Why the harness could not run or check (never a safety violation: those are the report's).
#[derive(Debug)]
pub enum CheckError {
    /// The command line is wrong.
    Usage(String),
    /// A file, socket or process could not be used.
    Io(std::io::Error),
    /// A lock could not be configured.
    Lock(lockingkit::LockError),
    /// A server fixture failed to start.
    Server(String),
    /// A history line could not be read.
    History(String),
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CheckError::Usage(message) => write!(f, "usage: {message}"),
            CheckError::Io(error) => write!(f, "i/o: {error}"),
            CheckError::Lock(error) => write!(f, "lock: {error}"),
            CheckError::Server(message) => write!(f, "server: {message}"),
            CheckError::History(message) => write!(f, "history: {message}"),
        }
    }
}

impl std::error::Error for CheckError {}

impl From<std::io::Error> for CheckError {
    fn from(error: std::io::Error) -> Self {
        CheckError::Io(error)
    }
}

impl From<lockingkit::LockError> for CheckError {
    fn from(error: lockingkit::LockError) -> Self {
        CheckError::Lock(error)
    }
}
