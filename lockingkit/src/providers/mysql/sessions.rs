//! The lock sessions of one backend: at most `max_sessions`, opened as attempts need them and
//! shared by every lock the backend holds.

use std::sync::{Arc, Mutex};

use super::connection::Connector;
use super::session::{lock, Session};
use crate::backend::BackendError;

/// The open lock sessions.
pub(super) struct LockSessions {
    connector: Arc<Connector>,
    max: usize,
    open: Mutex<Vec<Arc<Session>>>,
    /// One connect at a time: callers that need a new session while one opens wait for it.
    connecting: tokio::sync::Mutex<()>,
}

impl LockSessions {
    pub(super) fn new(connector: Arc<Connector>, max: usize) -> Self {
        LockSessions {
            connector,
            max: max.max(1),
            open: Mutex::new(Vec::new()),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    /// How many sessions are open.
    pub(super) fn count(&self) -> usize {
        let mut open = lock(&self.open);
        open.retain(|session| !session.is_ended());
        open.len()
    }

    /// A session for one statement: an open session with nothing to do, or a new one while
    /// the budget allows, or else the least busy open session.
    pub(super) async fn pick(&self) -> Result<Arc<Session>, BackendError> {
        loop {
            let (free, least_busy) = self.choose();
            if let Some(session) = free {
                return Ok(session);
            }
            // A new session is needed; one connect at a time.
            let gate = match self.connecting.try_lock() {
                Ok(gate) => gate,
                Err(_) => match least_busy {
                    Some(session) => return Ok(session),
                    None => {
                        // Wait for the connect in flight, then look again.
                        drop(self.connecting.lock().await);
                        if self.connector.is_failing() && self.count() == 0 {
                            // It failed: ask the backoff (which refuses at once) for the cause.
                            return self.open_one().await;
                        }
                        continue;
                    }
                },
            };
            let (free, least_busy) = self.choose();
            if let Some(session) = free {
                return Ok(session);
            }
            let opened = self.open_one().await;
            drop(gate);
            return match (opened, least_busy) {
                (Ok(session), _) => Ok(session),
                // The budget's other sessions still work: use one of them.
                (Err(_), Some(session)) => Ok(session),
                (Err(error), None) => Err(error),
            };
        }
    }

    /// Opens one session and adds it to the open ones.
    async fn open_one(&self) -> Result<Arc<Session>, BackendError> {
        let session = super::sentinel::open_watched(&self.connector).await?;
        lock(&self.open).push(session.clone());
        Ok(session)
    }

    /// Drops ended sessions (a session idle too long is closed by its sentinel, see
    /// `sentinel`), then returns a session with nothing to do (or the least busy one when the
    /// budget is spent), and the least busy session to fall back on.
    fn choose(&self) -> (Option<Arc<Session>>, Option<Arc<Session>>) {
        let mut open = lock(&self.open);
        open.retain(|session| !session.is_ended());
        let least_busy = open.iter().min_by_key(|session| session.busy()).cloned();
        let free = match &least_busy {
            Some(session) if session.busy() == 0 || open.len() >= self.max => Some(session.clone()),
            _ => None,
        };
        (free, least_busy)
    }

    /// Ends every session (the server frees their locks).
    pub(super) fn close_all(&self) {
        for session in lock(&self.open).drain(..) {
            session.end();
        }
    }
}
