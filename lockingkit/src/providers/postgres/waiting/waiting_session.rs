//! The waiting sessions: sessions of their own (never lock sessions, whose pipelined
//! statements would queue behind a waiting one) that queue in the server's lock queue for a
//! key. They open as every session does (see `SessionSettings::open`), then prepare their
//! slice statements. One whose grant a waiter claimed holds that waiter's lock (see
//! [`Adopted`]) and comes back once the lock is released; a clean one is kept briefly for the
//! next wait.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::super::schema::Schema;
use super::super::session::{Session, SessionSettings};
use super::slice::SliceStatements;

/// A clean waiting session nobody uses is kept this long for the next wait, then closed.
const LINGER: Duration = Duration::from_millis(200);

/// How many clean sessions a backend keeps for waits to come.
const MAX_IDLE: usize = 2;

/// A session that waits for one key at a time. Dropping it closes the connection; the server
/// drops a request still queued when its slice ends.
pub(super) struct WaitingSession {
    pub(super) session: Arc<Session>,
    pub(super) slices: SliceStatements,
    idle_since: Instant,
    /// Numbers the session while it lingers idle.
    id: u64,
    open: Arc<AtomicUsize>,
}

impl Drop for WaitingSession {
    fn drop(&mut self) {
        self.session.close();
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The waiting sessions of one backend: how they open, and the clean ones kept for reuse.
pub(super) struct WaitingSessions {
    settings: Arc<SessionSettings>,
    /// Names the watch function, which keeps the server's log clean (see `schema`).
    schema: Arc<Schema>,
    idle: Mutex<Idle>,
    /// Sessions open for waiting, busy or idle.
    open: Arc<AtomicUsize>,
    /// Of those, the ones that hold a claimed grant for a lease.
    adopted: AtomicUsize,
}

#[derive(Default)]
struct Idle {
    sessions: Vec<WaitingSession>,
    /// Numbers idle sessions, so a lingering one can be found again.
    next_id: u64,
    /// Set once the backend stops: nothing is kept from then on.
    stopped: bool,
}

impl WaitingSessions {
    pub(super) fn new(settings: Arc<SessionSettings>, schema: Arc<Schema>) -> Self {
        WaitingSessions {
            settings,
            schema,
            idle: Mutex::new(Idle::default()),
            open: Arc::new(AtomicUsize::new(0)),
            adopted: AtomicUsize::new(0),
        }
    }

    fn idle(&self) -> MutexGuard<'_, Idle> {
        // Every critical section leaves the list consistent.
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sessions open for waiting now, busy or idle.
    pub(super) fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Waiting sessions that hold a lease's lock now: they count against the budget of waiting
    /// sessions until the lease is released.
    pub(super) fn adopted(&self) -> usize {
        self.adopted.load(Ordering::Relaxed)
    }

    /// Whether connecting is failing now: a waiting session could not open either.
    pub(super) fn connecting_fails(&self) -> bool {
        self.settings.reconnect.is_failing()
    }

    /// A clean idle session that is still open, or a new one with its slice statements;
    /// `None` when none can open now.
    pub(super) async fn take(&self) -> Option<WaitingSession> {
        loop {
            let idle = self.idle().sessions.pop();
            match idle {
                Some(waiting)
                    if !waiting.session.is_closed() && waiting.idle_since.elapsed() < LINGER =>
                {
                    return Some(waiting)
                }
                Some(_) => continue,
                None => break,
            }
        }
        // Boxed: opening (TLS handshake included) is a large future, run rarely.
        let session = Box::pin(self.settings.open(Arc::new(Notify::new())))
            .await
            .ok()?;
        self.open.fetch_add(1, Ordering::Relaxed);
        let prepared = SliceStatements::prepare(session.client(), &self.schema);
        match crate::background::within(self.settings.timeout, prepared).await {
            Some(Ok(slices)) => Some(WaitingSession {
                session: Arc::new(session),
                slices,
                idle_since: Instant::now(),
                id: 0,
                open: self.open.clone(),
            }),
            _ => {
                session.close();
                self.open.fetch_sub(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Keeps a clean session for the next wait, up to [`MAX_IDLE`], for [`LINGER`].
    pub(super) fn keep(self: &Arc<Self>, mut waiting: WaitingSession) {
        waiting.idle_since = Instant::now();
        let mut idle = self.idle();
        if idle.sessions.len() >= MAX_IDLE || idle.stopped {
            return;
        }
        idle.next_id += 1;
        let id = idle.next_id;
        waiting.id = id;
        idle.sessions.push(waiting);
        drop(idle);
        let sessions = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(LINGER).await;
            if let Some(sessions) = sessions.upgrade() {
                // Closed outside the lock: dropping a session aborts its driver.
                let lingering: Vec<WaitingSession> = {
                    let mut idle = sessions.idle();
                    let (gone, kept) = std::mem::take(&mut idle.sessions)
                        .into_iter()
                        .partition(|waiting| waiting.id == id);
                    idle.sessions = kept;
                    gone
                };
                drop(lingering);
            }
        });
    }

    /// Hands `waiting`, whose grant a waiter claimed, to the waiter's lease: it comes back when
    /// the lease is gone.
    pub(super) fn adopt(self: &Arc<Self>, waiting: WaitingSession) -> Adopted {
        self.adopted.fetch_add(1, Ordering::Relaxed);
        Adopted {
            waiting: Some(waiting),
            home: Arc::downgrade(self),
        }
    }

    /// Closes the idle sessions and keeps none from now on.
    pub(super) fn stop(&self) {
        let idle = {
            let mut idle = self.idle();
            idle.stopped = true;
            std::mem::take(&mut idle.sessions)
        };
        drop(idle);
    }
}

/// A waiting session that holds a lease's lock: the lock its waiter claimed (see `waiting`).
/// Dropped with the lease, after the lease's own handle on the session: a session that holds
/// nothing and is still clean (its unlock answered, nothing unconfirmed) goes back to be kept
/// for the next wait; any other closes, which frees whatever it may still hold.
pub(in crate::providers::postgres) struct Adopted {
    waiting: Option<WaitingSession>,
    home: Weak<WaitingSessions>,
}

impl Drop for Adopted {
    fn drop(&mut self) {
        let Some(waiting) = self.waiting.take() else {
            return;
        };
        let Some(home) = self.home.upgrade() else {
            return;
        };
        home.adopted.fetch_sub(1, Ordering::Relaxed);
        // Nobody else (an unlock being settled) uses it, and it holds nothing.
        let clean = Arc::strong_count(&waiting.session) == 1
            && !waiting.session.is_closed()
            && waiting.session.holds_nothing();
        if clean && tokio::runtime::Handle::try_current().is_ok() {
            home.keep(waiting);
        }
    }
}
