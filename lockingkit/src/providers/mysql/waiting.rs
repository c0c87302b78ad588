//! Waiting for a key another session holds: the server's queue for a named lock hands the key
//! to this process's waiter the moment it is free, and the lock the server grants *is* the
//! waiter's.
//!
//! While this process's engine has a wait open for a key (from the waiter's first busy answer
//! until it leaves), the backend keeps a *watcher* for the key's name: a waiting session of its
//! own (never a lock session, whose other statements would queue behind it) blocked in
//! `GET_LOCK(name, 2)`, sent again each time it times out. The server grants it the moment the
//! name is free, however that happens: a release by LockingKit or by plain SQL, or the
//! holder's session ending (`KILL`, a crash). The request that waited then draws its
//! fencing token (see `take`), and the grant goes to the wait
//! ([`Woken::Granted`]), so no gap lies between the grant and the take. The lease then lives
//! on the waiting session as on a lock session: checks, loss when it ends, the normal unlock.
//! Once the lease is gone, the session goes back to the pool for the next wait.
//!
//! - While a watcher is queued for a key, the waits of that key make no attempts of their
//!   own: an attempt through a wait takes the grant the watcher holds for it, or is answered
//!   busy by the watcher's queued request (the server has not granted it, so someone holds the
//!   key).
//! - **When a wait ends**, what it kept goes with it at once: a grant nobody took is unlocked,
//!   and a request still queued is withdrawn by `KILL QUERY` on the waiting session (sent from
//!   a lock session; the interrupted `GET_LOCK` answers NULL, the session stays open, and the
//!   server logs nothing). Until that is done, this process's next attempt on the key waits
//!   for it ([`Watchers::settled`]), so nothing the wait left behind answers it busy.
//! - **Costing the server nothing lasting**: a waiting `GET_LOCK` holds no transaction, no
//!   snapshot and no table lock, and each waits at most [`SLICE`]. At most
//!   `max_wait_sessions` waiting sessions are busy per backend at once, watching or holding a
//!   grant; waits beyond that, and waits while the server cannot be reached (waiting sessions
//!   open through the backend's shared reconnect backoff), poll, which stays the fallback and
//!   the cap in every case.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::connection::Connector;
use super::errors::Stage;
use super::sentinel;
use super::session::{lock, Session};
use super::sessions::LockSessions;
use super::take::{take, Candidate, FencingSql, Taken};
use super::{MysqlBackend, MysqlLease};
use crate::backend::{Acquired, BackendError, LockBackend, LockMode, Wait, Woken};

/// How long one waiting `GET_LOCK` waits before it is sent again.
pub(super) const SLICE: Duration = Duration::from_secs(2);

/// How long a withdrawn watcher's `KILL QUERY` is given to end its request before it is sent
/// again.
const KILL_AGAIN: Duration = Duration::from_millis(100);

/// The watchers of one backend, and the waiting sessions they use.
pub(super) struct Watchers {
    connector: Arc<Connector>,
    /// Where `KILL QUERY` is sent from.
    sessions: Arc<LockSessions>,
    budget: usize,
    /// Waiting sessions watching or holding a grant.
    in_use: AtomicUsize,
    /// Waiting sessions with nothing to do, kept for the next wait.
    idle: Mutex<Vec<Arc<Session>>>,
    /// The watchers of each name: the last one is live unless withdrawn; the others are
    /// withdrawing.
    by_name: Mutex<HashMap<Arc<str>, Vec<Arc<Watcher>>>>,
    /// The fencing statements.
    sql: Arc<FencingSql>,
    stopped: CancellationToken,
}

/// One waiting session queued for one name, for the waits of that name.
pub(super) struct Watcher {
    name: Arc<str>,
    /// Open waits of the name (changed under `Watchers::by_name`).
    waits: AtomicUsize,
    state: Mutex<State>,
    /// Bumped when a grant arrives or the watcher ends.
    news: watch::Sender<u64>,
    /// The waiting session's connection id once its first request is sent (0 before).
    queued_on: AtomicU32,
    /// No wait is left: stop, and give back what is kept.
    withdrawn: CancellationToken,
    /// The watcher is over and left nothing on the name.
    done: CancellationToken,
}

/// Where a watcher is.
enum State {
    Watching,
    /// The server granted the name: the lease for a wait to take.
    Granted(Grant),
    /// The grant went to a wait.
    Taken,
    /// Over (failed, withdrawn or stopped).
    Ended,
}

/// A lock the server granted a watcher.
struct Grant {
    session: Arc<Session>,
    fencing_token: u64,
    sent: Instant,
}

impl Watchers {
    pub(super) fn new(
        connector: Arc<Connector>,
        sessions: Arc<LockSessions>,
        budget: usize,
        sql: Arc<FencingSql>,
    ) -> Arc<Self> {
        Arc::new(Watchers {
            connector,
            sessions,
            budget,
            in_use: AtomicUsize::new(0),
            idle: Mutex::new(Vec::new()),
            by_name: Mutex::new(HashMap::new()),
            sql,
            stopped: CancellationToken::new(),
        })
    }

    /// How many waiting sessions are busy (watching or holding a grant).
    pub(super) fn in_use(&self) -> usize {
        self.in_use.load(Ordering::Relaxed)
    }

    /// The live watcher of `name` for one more wait, started if none runs; `None` when the
    /// budget is spent (the wait polls).
    fn join(self: &Arc<Self>, name: &Arc<str>) -> Option<Arc<Watcher>> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        if self.stopped.is_cancelled() {
            return None;
        }
        let mut by_name = lock(&self.by_name);
        let watchers = by_name.entry(name.clone()).or_default();
        if let Some(live) = watchers.last().filter(|w| w.is_live()) {
            live.waits.fetch_add(1, Ordering::Relaxed);
            return Some(live.clone());
        }
        let reserved = self
            .in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.budget).then_some(n + 1)
            });
        if reserved.is_err() {
            return None;
        }
        let (news, _) = watch::channel(0);
        let watcher = Arc::new(Watcher {
            name: name.clone(),
            waits: AtomicUsize::new(1),
            state: Mutex::new(State::Watching),
            news,
            queued_on: AtomicU32::new(0),
            withdrawn: CancellationToken::new(),
            done: CancellationToken::new(),
        });
        watchers.push(watcher.clone());
        runtime.spawn(self.clone().watch(watcher.clone()));
        Some(watcher)
    }

    /// One wait of `watcher`'s name left; the last one withdraws it.
    fn leave(self: &Arc<Self>, watcher: &Arc<Watcher>) {
        let last = {
            let _by_name = lock(&self.by_name);
            watcher.waits.fetch_sub(1, Ordering::AcqRel) == 1
        };
        if last {
            self.withdraw(watcher);
        }
    }

    /// Withdraws `watcher`: a queued request is interrupted, a grant nobody took is unlocked
    /// (by the watcher's task, which waits for either).
    fn withdraw(self: &Arc<Self>, watcher: &Arc<Watcher>) {
        watcher.withdrawn.cancel();
        let id = watcher.queued_on.load(Ordering::Acquire);
        if id == 0 || !matches!(*lock(&watcher.state), State::Watching) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to send it from (the backend is being dropped outside one): the
            // request ends with its slice.
            return;
        };
        let sessions = self.sessions.clone();
        let done = watcher.done.clone();
        let give_up = self.connector.timeout.saturating_add(SLICE);
        runtime.spawn(async move {
            // Interrupts the waiting GET_LOCK. On a session between two statements it does
            // nothing, and a KILL that overtakes the next statement on its way to the server
            // misses it: sent again until the watcher is over.
            let began = Instant::now();
            while !done.is_cancelled() && began.elapsed() < give_up {
                if let Ok(session) = sessions.pick().await {
                    let kill = format!("KILL QUERY {id}");
                    let _ = session
                        .run(Stage::Attempt, move |conn| Box::pin(conn.query_drop(kill)))
                        .await;
                }
                let _ = tokio::time::timeout(KILL_AGAIN, done.clone().cancelled_owned()).await;
            }
        });
    }

    /// Waits until what ended waits left on `name` is gone: their queued requests withdrawn,
    /// their grants unlocked. Bounded by the statement timeout and a slice.
    pub(super) async fn settled(&self, name: &str) {
        let pending: Vec<CancellationToken> = match lock(&self.by_name).get(name) {
            Some(watchers) => watchers
                .iter()
                .filter(|w| w.withdrawn.is_cancelled())
                .map(|w| w.done.clone())
                .collect(),
            None => return,
        };
        let bound = self.connector.timeout.saturating_add(SLICE);
        for done in pending {
            let _ = tokio::time::timeout(bound, done.cancelled_owned()).await;
        }
    }

    /// Ends every watcher and closes the idle waiting sessions.
    pub(super) fn stop(self: &Arc<Self>) {
        self.stopped.cancel();
        let watchers: Vec<Arc<Watcher>> = lock(&self.by_name).values().flatten().cloned().collect();
        for watcher in watchers {
            self.withdraw(&watcher);
        }
        for session in lock(&self.idle).drain(..) {
            session.end();
        }
    }

    /// A waiting session: an idle one, or a new one (with its sentinel, see `sentinel`)
    /// through the reconnect backoff.
    async fn session(&self, fresh: bool) -> Result<Arc<Session>, BackendError> {
        if !fresh {
            if let Some(session) = self.idle_session() {
                return Ok(session);
            }
        }
        sentinel::open_watched(&self.connector).await
    }

    /// The most recently idle session that has not ended (its sentinel closes one left idle
    /// too long, see `sentinel`).
    fn idle_session(&self) -> Option<Arc<Session>> {
        let mut idle = lock(&self.idle);
        idle.retain(|session| !session.is_ended());
        idle.pop()
    }

    /// Puts a waiting session back for the next wait, or closes it if it cannot be reused.
    fn recycle(&self, session: &Arc<Session>) {
        if session.is_ended() {
            return;
        }
        let mut idle = lock(&self.idle);
        let reusable = session.holds() == 0 && session.busy() == 0;
        if !reusable || self.stopped.is_cancelled() || idle.len() >= self.budget {
            drop(idle);
            session.end();
        } else {
            idle.push(session.clone());
        }
    }

    /// The watcher's task: slices until granted, withdrawn or failed.
    async fn watch(self: Arc<Self>, watcher: Arc<Watcher>) {
        let granted = self.queue(&watcher).await;
        let handed = match granted {
            Some((session, grant)) => self.hand_over(&watcher, session, grant).await,
            None => false,
        };
        if !handed {
            self.in_use.fetch_sub(1, Ordering::AcqRel);
        }
        watcher.end();
        let mut by_name = lock(&self.by_name);
        if let Some(watchers) = by_name.get_mut(&watcher.name) {
            watchers.retain(|w| !Arc::ptr_eq(w, &watcher));
            if watchers.is_empty() {
                by_name.remove(&watcher.name);
            }
        }
    }

    /// Sends slices until the server grants the name (the session and the grant), the watcher
    /// is withdrawn or a slice fails (`None`).
    async fn queue(&self, watcher: &Watcher) -> Option<(Arc<Session>, Grant)> {
        let names: Arc<[Candidate]> = Arc::new([Candidate {
            name: watcher.name.clone(),
            slot: None,
        }]);
        let mut fresh = false;
        let mut session = self.session(fresh).await.ok()?;
        let seconds = u32::try_from(SLICE.as_secs()).unwrap_or(1);
        while !watcher.withdrawn.is_cancelled() && !self.stopped.is_cancelled() {
            watcher
                .queued_on
                .store(session.server_id(), Ordering::Release);
            let (holder, asked, sql) = (session.clone(), names.clone(), self.sql.clone());
            let answer = session
                .run_waiting(Stage::Attempt, SLICE, move |conn| {
                    Box::pin(take(conn, holder, asked, sql, seconds))
                })
                .await;
            match answer {
                Ok(Taken::Granted {
                    fencing_token,
                    confirmed,
                    ..
                }) => {
                    let grant = Grant {
                        session: session.clone(),
                        fencing_token,
                        sent: confirmed,
                    };
                    return Some((session, grant));
                }
                Ok(Taken::Busy) => {}
                // An idle connection the server had closed: one more try on a new one.
                Err(_) if session.was_broken() && !fresh => {
                    fresh = true;
                    session = self.session(fresh).await.ok()?;
                }
                Err(_) => return None,
                // The attempts that follow report it.
                Ok(Taken::Unusable(_)) => break,
            }
        }
        self.recycle(&session);
        None
    }

    /// Offers the grant to the waits; unlocks it if the watcher is withdrawn first. Whether a
    /// wait took it (its lease then owns the session and its place in the budget).
    async fn hand_over(&self, watcher: &Watcher, session: Arc<Session>, grant: Grant) -> bool {
        *lock(&watcher.state) = State::Granted(grant);
        watcher.news.send_modify(|n| *n += 1);
        watcher.withdrawn.cancelled().await;
        let left = std::mem::replace(&mut *lock(&watcher.state), State::Ended);
        match left {
            State::Granted(grant) => {
                drop(grant);
                if super::unlock(session.clone(), watcher.name.clone())
                    .await
                    .is_ok()
                {
                    self.recycle(&session);
                }
                false
            }
            _ => true,
        }
    }

    /// The lease of a grant a wait takes: on the waiting session, which goes back to the pool
    /// (and frees its place in the budget) when the lease is gone.
    fn lease(self: &Arc<Self>, watcher: &Watcher, grant: Grant) -> (Acquired<MysqlLease>, Instant) {
        let lease = MysqlLease {
            name: watcher.name.clone(),
            slot: None,
            session: grant.session.clone(),
            released: AtomicBool::new(false),
            _adopted: Some(Adopted {
                watchers: self.clone(),
                session: grant.session,
            }),
        };
        (
            Acquired {
                lease,
                fencing_token: grant.fencing_token,
            },
            grant.sent,
        )
    }
}

impl Watcher {
    /// Whether new waits may join: not withdrawn, not over.
    fn is_live(&self) -> bool {
        !self.withdrawn.is_cancelled() && matches!(*lock(&self.state), State::Watching)
    }

    /// Whether its request is queued at the server (or being sent again).
    fn is_queued(&self) -> bool {
        self.queued_on.load(Ordering::Acquire) != 0 && matches!(*lock(&self.state), State::Watching)
    }

    /// Whether it is over without a grant to take.
    fn is_over(&self) -> bool {
        matches!(*lock(&self.state), State::Ended | State::Taken)
    }

    /// The grant, if the server granted the name and no wait took it yet.
    fn take_grant(&self) -> Option<Grant> {
        let mut state = lock(&self.state);
        match std::mem::replace(&mut *state, State::Taken) {
            State::Granted(grant) => Some(grant),
            other => {
                *state = other;
                None
            }
        }
    }

    fn end(&self) {
        {
            let mut state = lock(&self.state);
            if matches!(*state, State::Watching) {
                *state = State::Ended;
            }
        }
        self.news.send_modify(|n| *n += 1);
        self.done.cancel();
    }
}

/// A lease on a waiting session: gives the session back to the watchers' pool when dropped.
pub(super) struct Adopted {
    watchers: Arc<Watchers>,
    session: Arc<Session>,
}

impl Drop for Adopted {
    fn drop(&mut self) {
        self.watchers.recycle(&self.session);
        self.watchers.in_use.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One caller's wait: a plain lock's is served by its name's watcher (or polls when none could
/// start); a semaphore's polls.
pub(super) struct MysqlWait {
    backend: Arc<MysqlBackend>,
    key: Arc<str>,
    mode: LockMode,
    watcher: Option<Arc<Watcher>>,
}

impl MysqlWait {
    pub(super) fn open(backend: Arc<MysqlBackend>, key: &str, mode: LockMode) -> Self {
        let watcher = match mode {
            LockMode::Exclusive => {
                let name: Arc<str> = Arc::from(super::MysqlLockKeys::lock_name(key));
                backend.inner.watchers.join(&name)
            }
            _ => None,
        };
        MysqlWait {
            backend,
            key: Arc::from(key),
            mode,
            watcher,
        }
    }
}

impl Drop for MysqlWait {
    fn drop(&mut self) {
        if let Some(watcher) = self.watcher.take() {
            self.backend.inner.watchers.leave(&watcher);
        }
    }
}

impl Wait for MysqlWait {
    type Lease = MysqlLease;

    fn try_acquire(
        &mut self,
    ) -> impl Future<Output = Result<Option<Acquired<MysqlLease>>, BackendError>> + Send + 'static
    {
        let (backend, key, mode) = (self.backend.clone(), self.key.clone(), self.mode);
        let watcher = self.watcher.clone();
        async move {
            if let Some(watcher) = watcher {
                if let Some(grant) = watcher.take_grant() {
                    let watchers = &backend.inner.watchers;
                    return Ok(Some(watchers.lease(&watcher, grant).0));
                }
                if watcher.is_queued() {
                    // The server has not granted the queued request: someone holds the key.
                    return Ok(None);
                }
            }
            backend.try_acquire(&key, mode).await
        }
    }

    async fn changed(&mut self) -> Woken<MysqlLease> {
        let Some(watcher) = self.watcher.clone() else {
            return std::future::pending().await;
        };
        let mut news = watcher.news.subscribe();
        loop {
            if let Some(grant) = watcher.take_grant() {
                let (acquired, sent) = self.backend.inner.watchers.lease(&watcher, grant);
                return Woken::Granted { acquired, sent };
            }
            if watcher.is_over() {
                // The watcher failed or stopped: attempts go to the server from now on,
                // polling, and the next one at once.
                if let Some(watcher) = self.watcher.take() {
                    self.backend.inner.watchers.leave(&watcher);
                }
                return Woken::Retry;
            }
            if news.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}
