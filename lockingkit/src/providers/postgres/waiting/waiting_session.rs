//! The waiting sessions: sessions of their own (never lock sessions, whose pipelined
//! statements would queue behind a waiting one) that queue in the server's lock queue for a
//! key. They open as every session does (see `SessionSettings::open`), then prepare their
//! slice statements; a clean one is kept briefly for the next wait.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::super::schema::Schema;
use super::super::session::{Session, SessionSettings};
use super::slice::SliceStatements;

/// A clean waiting session nobody uses is kept this long for the next wait, then closed; a
/// key's waiters gone this long have left (the engine makes a new hint before each attempt,
/// so between two rounds of one wait there is briefly none).
pub(super) const LINGER: Duration = Duration::from_millis(200);

/// How many clean sessions a backend keeps for waits to come.
const MAX_IDLE: usize = 2;

/// A session that waits for one key at a time. Dropping it closes the connection; the server
/// drops a request still queued when its slice ends.
pub(super) struct WaitingSession {
    pub(super) session: Session,
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
                session,
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
