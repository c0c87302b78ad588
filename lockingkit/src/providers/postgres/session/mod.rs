//! One PostgreSQL server session, and the one way every session of a backend opens.
//!
//! Lock sessions (see `lock_sessions`) and waiting sessions (see `waiting`) are both this
//! type, opened by [`SessionSettings::open`]: through the backend's shared reconnect backoff
//! (see `reconnect`), with its TLS settings, and verified by the pooler probe (see `pooler`).
//! Many locks live on one lock session: tokio-postgres pipelines the statements that
//! concurrent callers send on one client, so attempts, unlocks and checks of different locks
//! do not wait for each other's round trips.
//!
//! Each job of a session has a file of its own:
//! - `statements`: the statements of the lock protocol, prepared once per session;
//! - `holds`: which advisory locks the session holds, attempts or may hold;
//! - `unconfirmed`: settling what an unanswered attempt or unlock may have left held;
//! - `check`: the periodic check that vouches for every lock on the session;
//! - `deadline`: the timeout of one statement.

mod check;
mod deadline;
mod holds;
mod statements;
mod unconfirmed;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Config, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

use super::errors::{self, Stage};
use super::pooler::{Pooling, ServerProcess};
use crate::backend::BackendError;
use crate::providers::reconnect::Reconnect;
pub(super) use deadline::Bounded;
pub(super) use holds::{Advisory, Attempt, Availability};
pub(super) use statements::Prepared;

/// How every session of one backend connects, shared by its lock sessions and waiting
/// sessions: the connection settings, TLS, the connect timeout, the reconnect backoff, and
/// what is known about a pooler in front of the server.
pub(super) struct SessionSettings {
    pub(super) config: Config,
    pub(super) tls: MakeRustlsConnect,
    /// Bounds the connect and the pooler probe, as every statement.
    pub(super) timeout: Duration,
    pub(super) reconnect: Arc<Reconnect>,
    pub(super) pooling: Arc<Pooling>,
}

impl SessionSettings {
    /// Opens a session through the shared reconnect backoff: while connecting fails, the
    /// latest failure is returned at once without touching the server. `changed` is told when
    /// the session ends or stops draining.
    pub(super) async fn open(&self, changed: Arc<Notify>) -> Result<Session, BackendError> {
        self.reconnect.connect(Session::open(self, changed)).await
    }

    /// Opens a session outside the backoff: the startup check's throwaway session, whose
    /// failure is reported to its caller and must not hold the backend's locks back.
    pub(super) async fn open_unthrottled(&self) -> Result<Session, BackendError> {
        Session::open(self, Arc::new(Notify::new())).await
    }
}

/// One PostgreSQL server session: a lock session shared by many locks, or a waiting session
/// that queues in the server's lock queue for a key and holds what it is granted for the
/// waiter it wakes.
pub(super) struct Session {
    client: Client,
    ended: CancellationToken,
    statements: [OnceLock<Statement>; Prepared::COUNT],
    holds: Mutex<holds::Keys>,
    /// Statements sent and not answered yet, to spread new attempts over sessions.
    in_flight: AtomicUsize,
    check: Mutex<check::CheckState>,
    /// The notifier of whoever opened the session: told when this session ends or stops
    /// draining, so attempts that found every session draining look again at once.
    changed: Arc<Notify>,
    solo_timer: deadline::SoloTimer,
    driver: JoinHandle<()>,
    /// The server process the session was opened on, which every check's answer must name.
    server_process: ServerProcess,
    pooling: Arc<Pooling>,
}

impl Session {
    /// Opens a session: connects within `timeout` and starts the task that drives it.
    async fn open(
        settings: &SessionSettings,
        changed: Arc<Notify>,
    ) -> Result<Session, BackendError> {
        let SessionSettings {
            config,
            tls,
            timeout,
            pooling,
            ..
        } = settings;
        let timeout = *timeout;
        let connecting = config.connect(tls.clone());
        let (client, connection) = match crate::background::within(timeout, connecting).await {
            Some(Ok(pair)) => pair,
            Some(Err(error)) => return Err(errors::query_error(error, Stage::Connect)),
            None => return Err(errors::timed_out(Stage::Connect, timeout)),
        };
        let ended = CancellationToken::new();
        let signal = ended.clone().drop_guard();
        let ended_notice = EndedNotice(changed.clone());
        let driver = tokio::spawn(async move {
            // Cancel `ended` and tell the set when the connection finishes or this task is
            // aborted: a session that ends frees its slot for attempts waiting on the set.
            // Dropped in reverse order: `ended` is cancelled before the set looks again.
            let _notice = ended_notice;
            let _signal = signal;
            let _ = connection.await;
        });
        let verified = pooling.verify_new_session(&client, config, tls, timeout);
        let server_process = match verified.await {
            Ok(process) => process,
            Err(error) => {
                driver.abort();
                return Err(error);
            }
        };
        Ok(Session {
            client,
            ended,
            statements: Default::default(),
            holds: Mutex::new(holds::Keys::default()),
            in_flight: AtomicUsize::new(0),
            check: Mutex::new(check::CheckState::default()),
            changed,
            solo_timer: deadline::SoloTimer::new(),
            driver,
            server_process,
            pooling: pooling.clone(),
        })
    }

    pub(super) fn client(&self) -> &Client {
        &self.client
    }

    /// Cancelled once the session is over (closed by either side, or dropped).
    pub(super) fn ended(&self) -> &CancellationToken {
        &self.ended
    }

    pub(super) fn is_closed(&self) -> bool {
        self.ended.is_cancelled() || self.client.is_closed()
    }

    /// Ends the session: the socket closes and the server frees every lock it held.
    pub(super) fn close(&self) {
        self.driver.abort();
        self.ended.cancel();
    }

    /// Statements in flight on this session.
    pub(super) fn load(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }
}

/// Tells the session set, when dropped, that a session ended.
struct EndedNotice(Arc<Notify>);

impl Drop for EndedNotice {
    fn drop(&mut self) {
        self.0.notify_waiters();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Stops driving the connection: the socket closes and the server ends the session,
        // freeing any lock it held.
        self.driver.abort();
    }
}
