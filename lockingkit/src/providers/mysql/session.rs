//! One server session that holds locks: its connection, the lock names it holds, and how a
//! statement runs on it.
//!
//! A MySQL connection runs one statement at a time, so a session's statements take turns on
//! its connection. A statement that does not finish — no answer within the statement timeout,
//! a broken connection, a caller that went away mid-statement — leaves the connection's
//! protocol state unknown, and ends the session: its socket is closed, which makes the server
//! free every lock the session held, and each of those leases sees its loss at once.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::Conn;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::connection;
use super::errors::{self, Stage};
use super::take::Counter;
use crate::backend::BackendError;

/// A statement's future, borrowing the connection it runs on.
pub(super) type StatementFuture<'c, T> =
    Pin<Box<dyn Future<Output = Result<T, mysql_async::Error>> + Send + 'c>>;

/// One lock session.
pub(super) struct Session {
    /// The server's id for the connection (`CONNECTION_ID()`, what `KILL` takes).
    server_id: u32,
    /// The connection while the session lives; taken out when it ends.
    conn: tokio::sync::Mutex<Option<Conn>>,
    /// Cancelled when the session ends, for whatever reason.
    ended: CancellationToken,
    /// Set when a statement found the connection closed or broken (rather than unanswered).
    broken: AtomicBool,
    /// The lock names the session holds. Changed only by a statement that holds the
    /// connection, so it is exact whenever the connection is free.
    held: Mutex<HashSet<Arc<str>>>,
    /// Statements waiting for or running on the connection.
    busy: AtomicUsize,
    /// When the server last answered on this session.
    answered: Mutex<Instant>,
    /// One check at a time: a second waits for the first and needs no round trip of its own.
    checking: tokio::sync::Mutex<()>,
    /// The fencing epoch this session draws tokens in, once read (see `take`).
    counter: Mutex<Option<Counter>>,
    timeout: Duration,
}

impl Session {
    /// A session on a connection already open.
    pub(super) fn with(conn: Conn, timeout: Duration) -> Session {
        Session {
            server_id: conn.id(),
            conn: tokio::sync::Mutex::new(Some(conn)),
            ended: CancellationToken::new(),
            broken: AtomicBool::new(false),
            held: Mutex::new(HashSet::new()),
            busy: AtomicUsize::new(0),
            answered: Mutex::new(Instant::now()),
            checking: tokio::sync::Mutex::new(()),
            counter: Mutex::new(None),
            timeout,
        }
    }

    /// The server's connection id.
    pub(super) fn server_id(&self) -> u32 {
        self.server_id
    }

    /// Whether the session has ended.
    pub(super) fn is_ended(&self) -> bool {
        self.ended.is_cancelled()
    }

    /// Cancelled when the session ends.
    pub(super) fn ended(&self) -> &CancellationToken {
        &self.ended
    }

    /// Whether a statement found the connection closed or broken: the server had closed it
    /// (a restart, `KILL`, its idle timeout) before or while the statement was sent.
    pub(super) fn was_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// The fencing epoch the session read, if it did.
    pub(super) fn counter(&self) -> Option<Counter> {
        *lock(&self.counter)
    }

    /// Keeps the fencing epoch the session read (`None` to read it again).
    pub(super) fn set_counter(&self, counter: Option<Counter>) {
        *lock(&self.counter) = counter;
    }

    /// How many locks the session holds.
    pub(super) fn holds(&self) -> usize {
        self.names().len()
    }

    /// Statements waiting for or running on the connection.
    pub(super) fn busy(&self) -> usize {
        self.busy.load(Ordering::Relaxed)
    }

    /// How long since the server last answered on this session.
    pub(super) fn quiet_for(&self) -> Duration {
        lock(&self.answered).elapsed()
    }

    /// The names the session holds (exact while no statement runs on it).
    pub(super) fn names(&self) -> MutexGuard<'_, HashSet<Arc<str>>> {
        lock(&self.held)
    }

    /// Ends the session: no statement runs on it any more, and its connection is closed once
    /// the statement running now (if any) is over.
    pub(super) fn end(&self) {
        if self.ended.is_cancelled() {
            return;
        }
        self.ended.cancel();
        if let Ok(mut slot) = self.conn.try_lock() {
            if let Some(conn) = slot.take() {
                connection::close(conn, self.timeout);
            }
        }
        // Otherwise the running statement closes it when it finishes (see `Running`).
    }

    /// Runs one statement with the connection to itself, under the statement timeout (which
    /// also bounds the wait for the connection). A statement that does not finish ends the
    /// session (see the module docs).
    pub(super) async fn run<T>(
        &self,
        stage: Stage,
        statement: impl for<'c> FnOnce(&'c mut Conn) -> StatementFuture<'c, T>,
    ) -> Result<T, BackendError> {
        self.run_waiting(stage, Duration::ZERO, statement).await
    }

    /// [`run`](Self::run) for a statement that waits up to `wait` at the server on purpose
    /// (a waiting session's `GET_LOCK`): the timeout is that much longer.
    pub(super) async fn run_waiting<T>(
        &self,
        stage: Stage,
        wait: Duration,
        statement: impl for<'c> FnOnce(&'c mut Conn) -> StatementFuture<'c, T>,
    ) -> Result<T, BackendError> {
        self.busy.fetch_add(1, Ordering::Relaxed);
        let _busy = Busy(&self.busy);
        let timeout = self.timeout.saturating_add(wait);
        let deadline = Instant::now() + timeout;
        // A free connection is taken without arming a timer for the wait.
        let slot = match self.conn.try_lock() {
            Ok(slot) => slot,
            Err(_) => match tokio::time::timeout_at(deadline, self.conn.lock()).await {
                Ok(slot) => slot,
                Err(_) => return Err(errors::timed_out(stage, timeout)),
            },
        };
        let mut running = Running {
            session: self,
            slot,
            finished: false,
        };
        let Some(conn) = running.slot.as_mut().filter(|_| !self.is_ended()) else {
            return Err(errors::session_gone(
                stage,
                "the MySQL session ended".to_owned(),
            ));
        };
        match tokio::time::timeout_at(deadline, statement(conn)).await {
            Ok(Ok(value)) => {
                running.finished = true;
                *lock(&self.answered) = Instant::now();
                Ok(value)
            }
            Ok(Err(error)) => {
                // Dropped unfinished, `running` ends the session.
                let broken = errors::breaks_session(&error);
                self.broken.store(broken, Ordering::Relaxed);
                running.finished = !broken;
                Err(errors::query_error(error, stage))
            }
            Err(_) => Err(errors::timed_out(stage, timeout)),
        }
    }

    /// Checks that the session still answers. A recent answer to any statement vouches for
    /// it; otherwise one ping does. The ping runs in a task of its own, so a caller that stops
    /// waiting for it (the engine bounds checks) does not cut it off mid-statement, which would
    /// end the session and every other lock on it.
    pub(super) async fn check(self: &Arc<Self>, interval: Duration) -> Result<(), BackendError> {
        if self.is_ended() {
            return Err(BackendError::lease_gone("the lock's MySQL session ended"));
        }
        let fresh = interval / 2;
        if self.quiet_for() < fresh {
            return Ok(());
        }
        let session = self.clone();
        detached(async move {
            let _checking = session.checking.lock().await;
            if session.quiet_for() < fresh {
                return Ok(());
            }
            session.run(Stage::Held, |conn| Box::pin(conn.ping())).await
        })
        .await
    }
}

/// Runs `work` in a task of its own and waits for it: dropping the wait leaves the work to
/// finish, so a statement is never cut off by a caller that went away.
async fn detached<T: Send + 'static>(
    work: impl Future<Output = Result<T, BackendError>> + Send + 'static,
) -> Result<T, BackendError> {
    match tokio::spawn(work).await {
        Ok(result) => result,
        Err(_) => Err(BackendError::permanent("a MySQL statement's task failed")),
    }
}

/// A statement holding the connection. Dropped before it finished, it ends the session and
/// closes the connection; so does a session that ended while it ran.
struct Running<'s> {
    session: &'s Session,
    slot: tokio::sync::MutexGuard<'s, Option<Conn>>,
    finished: bool,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if !self.finished || self.session.is_ended() {
            self.session.ended.cancel();
            if let Some(conn) = self.slot.take() {
                connection::close(conn, self.session.timeout);
            }
        }
    }
}

/// Counts a statement out of its session's `busy` when it is over.
struct Busy<'a>(&'a AtomicUsize);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Locks a std mutex whose data stays valid whatever a panicking holder left.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
