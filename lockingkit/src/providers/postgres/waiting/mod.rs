//! Waiting for a key another session holds: the server's lock queue hands the key to this
//! process's waiter the moment it is free, and the lock the server grants *is* the waiter's.
//!
//! Without this, a waiter in another process learns of a release only at its next attempt, up
//! to the maximum retry delay later, and a reader or writer that asks at the right moment gets
//! in ahead of it. So while this process's engine has a wait open for a key (see
//! [`Wait`](crate::backend::Wait): from the waiter's first busy answer until it leaves), the
//! backend keeps a *watcher* for the key: a waiting session of its own (never a lock session,
//! whose pipelined statements would queue behind it) that queues for the same advisory key in
//! the server's lock queue. The server grants it the moment the key is free for it, however
//! that happens: an unlock by LockingKit or by plain SQL, or the holder's session ending (a
//! crash, `pg_terminate_backend`). The statement that waited keeps the lock and takes its
//! fencing token in the same round trip (see `slice`), and the grant goes to the wait of its
//! kind ([`Woken::Granted`](crate::backend::Woken)), so no gap lies between the grant and the
//! take. The lease then lives on the waiting session as on any lock session: the session's
//! periodic check, loss when it ends, release by the normal unlock, the unconfirmed-unlock
//! protocol. Once the lease is gone, a clean session comes back for the next wait (see
//! `waiting_session`).
//!
//! # One request per key at the server
//! While a watcher runs for a key, the waits of that key make no attempts of their own: an
//! attempt through a wait takes the grant the watcher holds for it, or is answered "busy" by
//! the request the watcher has queued (the server has not granted it, so someone holds the
//! key). A lock session's attempt beside the watcher's request could be granted with it — two
//! readers' grants for one waiter, one of them held for nobody — so attempts go to a lock
//! session only while no watcher runs (none could start: the budget below, or connecting
//! fails).
//!
//! # Writers and readers
//! A watcher queues *exclusively* while a writer (or plain lock) of this process waits for the
//! key, and *shared* while only readers wait. An exclusive grant goes to a writer's wait, a
//! shared one to a reader's. Queued exclusively, the request is the writer's intent, which
//! every reader respects: the server refuses a `pg_try_advisory_lock_shared` that conflicts
//! with a *queued* request, and queues a blocking `pg_advisory_lock_shared` behind it (a
//! LockingKit session that already reads the key looks for a queued writer itself, since the
//! server would grant it without looking). So from the moment a writer's watcher queues, no new
//! reader gets in anywhere, and the server grants the writer the key once the readers holding
//! then are gone. The intent lapses only between two slices (one round trip), and a blocking
//! reader that queued behind a slice is granted when that slice ends unanswered; so against
//! readers that each hold the key longer than a slice, the writer waits for them too.
//!
//! # When a wait ends
//! A wait ends when its waiter leaves, and what it kept goes with it at once:
//! - a grant of its kind that nobody took is unlocked;
//! - the watcher's request queued for its kind is withdrawn (`pg_cancel_backend` on a lock
//!   session, which the wait function answers with NULL; see `schema`) — a queued writer's
//!   request would hold readers back, and would be granted at the holder's release, for nobody.
//!
//! Until that is done, this process's next attempt on the key, in any mode, waits for it
//! ([`Watchers::settled`]), so nothing the wait left behind answers it "busy". Without a
//! withdrawable request (a database with an older wait function, or the plain statements) the
//! request ends with its slice instead, and such an attempt waits up to that long.
//!
//! # Costing the server nothing lasting
//! A statement that waits in a lock queue keeps a snapshot (`backend_xmin`) for as long as it
//! waits: VACUUM cannot remove rows that died after it, and CREATE INDEX CONCURRENTLY waits for
//! it — and deadlocks against a holder that runs one. So a watcher never waits long in one
//! statement: each waits at most [`SLICE`](slice::SLICE) (or half the server's
//! `deadlock_timeout`, if that is shorter) under `lock_timeout`, and one that times out is sent
//! again at once. Each snapshot lives at most one slice; the deadlock detector, which looks
//! only after `deadlock_timeout`, finds the wait already gone. A release between two slices is
//! seen by the next one, which is granted at once, so nothing is missed. A slice is one call of
//! the wait function (see `schema`), which catches the timeout, so the server logs nothing;
//! without the function (a role that may not create it, and nobody did) it is a plain
//! statement whose timeout the server logs as an ERROR.
//!
//! - A watcher starts when a wait of the key opens and none runs, and ends when nobody waits
//!   any more or it was granted the key for a wait (the session is the grant's then; a watcher
//!   for the waits still open starts afresh). It never sends a statement after its grant, so
//!   nothing of this process stays queued behind its waiter's hold.
//! - At most `max_wait_sessions` waiting sessions are busy per backend at once, watching or
//!   holding a grant; waits beyond that, and waits while the server cannot be reached (waiting
//!   sessions open through the backend's shared reconnect backoff, see `reconnect`), are served
//!   by polling, which stays the fallback and the cap in every case.
//! - A queued watcher never waits long enough for the deadlock detector to look at it, and a
//!   waiting session that holds a grant waits for nothing, so neither can take part in a
//!   deadlock.

mod slice;
mod wait;
mod waiting_session;
mod watcher;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{watch as channel, Notify};
use tokio::time::Instant;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_util::sync::CancellationToken;

use super::lock_sessions::LockSessions;
use super::schema::Schema;
use super::session::{Advisory, Session, SessionSettings};
pub(in crate::providers::postgres) use wait::PostgresWait;
pub(super) use waiting_session::Adopted;
use waiting_session::{WaitingSession, WaitingSessions};

/// The watchers of one backend, the waits they serve, and the grants they hold for them.
pub(super) struct Watchers {
    shared: Arc<WatchState>,
}

struct WatchState {
    keys: Mutex<HashMap<i64, Arc<KeyWaits>>>,
    stop: CancellationToken,
    /// The most waiting sessions busy at once (`max_wait_sessions`).
    max_watchers: usize,
    /// Waiting sessions busy now: watching, or holding a grant not yet taken.
    busy: AtomicUsize,
    sessions: Arc<WaitingSessions>,
    /// Where a queued request is withdrawn from (any lock session will do).
    lock_sessions: Arc<LockSessions>,
    /// Keys with a clean-up in flight: attempts on them wait for it (see [`Watchers::settled`]).
    /// Zero almost always, which spares every attempt a look at the map.
    settling: AtomicUsize,
    /// The statement timeout: how long a watch statement may go unanswered beyond its slice
    /// before its session is considered broken, and the limit of an unlock or a withdrawal.
    timeout: Duration,
}

/// The waits of one key in this process, and what the watcher keeps for them.
struct KeyWaits {
    state: Mutex<KeyState>,
    /// Told when a grant is parked or a watcher ends: the key's waits look again.
    events: channel::Sender<()>,
    /// Told when the last clean-up of the key is done.
    settled: Notify,
}

#[derive(Default)]
struct KeyState {
    /// Open waits of writers (and plain locks), and of readers.
    writers: usize,
    readers: usize,
    /// A watcher runs for the key.
    watching: bool,
    /// Attempts of the key's waits in flight on lock sessions: no watcher starts meanwhile, so
    /// a wait never has a request of its own at the server beside the watcher's.
    attempting: usize,
    /// The request the watcher has queued at the server, while it is there.
    queued: Option<Queued>,
    /// What the server granted the watcher, until a wait of its kind takes it.
    grant: Option<Grant>,
    /// Clean-ups in flight: unlocks of grants nobody took, and withdrawals.
    settling: usize,
}

/// A watch statement in the server's lock queue.
#[derive(Clone, Copy)]
struct Queued {
    exclusive: bool,
    /// The session's server process, if the request can be withdrawn early.
    process: Option<i32>,
    /// A withdrawal was sent (and counts in `settling` until the statement answers).
    withdrawn: bool,
}

/// A lock the server granted a waiting session for this process's waits.
struct Grant {
    waiting: WaitingSession,
    exclusive: bool,
    fencing_token: i64,
    /// When the statement that was granted was sent.
    sent: Instant,
}

/// A grant a wait took: the lease's lock, on the waiting session it was granted to.
pub(super) struct Claimed {
    pub(super) session: Arc<Session>,
    pub(super) hold: Advisory,
    pub(super) fencing_token: u64,
    pub(super) adopted: Adopted,
    pub(super) sent: Instant,
}

impl KeyState {
    fn waits(&self, exclusive: bool) -> usize {
        if exclusive {
            self.writers
        } else {
            self.readers
        }
    }

    fn waits_mut(&mut self, exclusive: bool) -> &mut usize {
        if exclusive {
            &mut self.writers
        } else {
            &mut self.readers
        }
    }

    /// How the next slice queues: exclusively while a writer waits, shared while only readers
    /// do, not at all once nobody waits.
    fn wanted(&self) -> Option<bool> {
        if self.writers > 0 {
            Some(true)
        } else if self.readers > 0 {
            Some(false)
        } else {
            None
        }
    }

    /// A wait's attempt may go to a lock session (no watcher runs): it is counted until it
    /// ends. `false` while a watcher runs.
    fn begin_attempt(&mut self) -> bool {
        if self.watching {
            return false;
        }
        self.attempting += 1;
        true
    }

    /// Nothing is kept for the key any more: its entry can go.
    fn is_idle(&self) -> bool {
        self.writers == 0
            && self.readers == 0
            && !self.watching
            && self.grant.is_none()
            && self.settling == 0
    }
}

impl KeyWaits {
    fn new() -> Self {
        KeyWaits {
            state: Mutex::new(KeyState::default()),
            events: channel::Sender::new(()),
            settled: Notify::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, KeyState> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Watchers {
    pub(super) fn new(
        settings: Arc<SessionSettings>,
        max_watchers: usize,
        schema: Arc<Schema>,
        lock_sessions: Arc<LockSessions>,
    ) -> Self {
        let timeout = settings.timeout;
        Watchers {
            shared: Arc::new(WatchState {
                keys: Mutex::new(HashMap::new()),
                stop: CancellationToken::new(),
                max_watchers,
                busy: AtomicUsize::new(0),
                sessions: Arc::new(WaitingSessions::new(settings, schema)),
                lock_sessions,
                settling: AtomicUsize::new(0),
                timeout,
            }),
        }
    }

    /// Waiting sessions open now: watching, holding a grant, or idle.
    pub(super) fn sessions(&self) -> usize {
        self.shared.sessions.open()
    }

    /// Resolves once nothing an ended wait left on `advisory_key` (a grant nobody took, a
    /// request being withdrawn) is still at the server: at once almost always.
    pub(super) async fn settled(&self, advisory_key: i64) {
        if self.shared.settling.load(Ordering::Acquire) == 0 {
            return;
        }
        let Some(key) = self.shared.key(advisory_key) else {
            return;
        };
        loop {
            let settled = key.settled.notified();
            let mut settled = std::pin::pin!(settled);
            settled.as_mut().enable();
            if key.state().settling == 0 {
                return;
            }
            settled.await;
        }
    }

    /// Ends every watcher and closes their sessions: waiters poll from now on.
    pub(super) fn stop(&self) {
        self.shared.stop.cancel();
        self.shared.sessions.stop();
    }
}

impl Drop for Watchers {
    fn drop(&mut self) {
        self.stop();
    }
}

impl WatchState {
    fn keys(&self) -> MutexGuard<'_, HashMap<i64, Arc<KeyWaits>>> {
        // Every critical section leaves the map consistent.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn key(&self, advisory_key: i64) -> Option<Arc<KeyWaits>> {
        self.keys().get(&advisory_key).cloned()
    }

    /// A wait of this kind opens for `advisory_key`: its entry, and a watcher if none runs.
    fn open(self: &Arc<Self>, advisory_key: i64, exclusive: bool) -> Arc<KeyWaits> {
        let key = self
            .keys()
            .entry(advisory_key)
            .or_insert_with(|| Arc::new(KeyWaits::new()))
            .clone();
        *key.state().waits_mut(exclusive) += 1;
        self.start_watcher(advisory_key, &key);
        key
    }

    /// Starts the key's watcher if a wait needs one, none runs, the budget of waiting sessions
    /// has room, and connecting does not fail (a watcher could not connect either).
    fn start_watcher(self: &Arc<Self>, advisory_key: i64, key: &Arc<KeyWaits>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.stop.is_cancelled() || self.sessions.connecting_fails() {
            return;
        }
        let mut state = key.state();
        if state.watching || state.attempting > 0 || state.wanted().is_none() {
            return;
        }
        let busy = self.busy.load(Ordering::Acquire) + self.sessions.adopted();
        if busy >= self.max_watchers {
            return;
        }
        state.watching = true;
        self.busy.fetch_add(1, Ordering::AcqRel);
        drop(state);
        runtime.spawn(watcher::watcher(self.clone(), advisory_key, key.clone()));
    }

    /// A wait of this kind for `advisory_key` ended (`counted` unless it took a grant, which
    /// already ended its count): if it was the last of its kind, the grant kept for that kind
    /// is unlocked and the request queued for it withdrawn.
    fn close(
        self: &Arc<Self>,
        advisory_key: i64,
        key: &Arc<KeyWaits>,
        exclusive: bool,
        counted: bool,
    ) {
        let mut state = key.state();
        if counted {
            let waits = state.waits_mut(exclusive);
            *waits = waits.saturating_sub(1);
        }
        if counted && state.waits(exclusive) == 0 {
            if state
                .grant
                .as_ref()
                .is_some_and(|g| g.exclusive == exclusive)
            {
                if let Some(grant) = state.grant.take() {
                    self.begin_settling(&mut state);
                    self.busy.fetch_sub(1, Ordering::AcqRel);
                    let shared = self.clone();
                    let key = key.clone();
                    tokio::spawn(async move {
                        shared.unlock_unclaimed(advisory_key, grant).await;
                        shared.end_settling(advisory_key, &key);
                    });
                }
            }
            if let Some(queued) = state.queued.as_mut() {
                if queued.exclusive == exclusive && !queued.withdrawn {
                    queued.withdrawn = true;
                    let process = queued.process;
                    self.begin_settling(&mut state);
                    if let Some(process) = process {
                        tokio::spawn(withdraw(self.clone(), process));
                    }
                }
            }
        }
        let idle = state.is_idle();
        drop(state);
        if idle {
            self.forget_if_idle(advisory_key);
        } else {
            // The waits of the other kind go on, and the watcher may have been the ended
            // kind's: one for them starts if none runs.
            self.start_watcher(advisory_key, key);
        }
    }

    fn begin_settling(&self, state: &mut KeyState) {
        state.settling += 1;
        self.settling.fetch_add(1, Ordering::AcqRel);
    }

    /// One clean-up of the key is done.
    fn end_settling(&self, advisory_key: i64, key: &KeyWaits) {
        let mut state = key.state();
        state.settling = state.settling.saturating_sub(1);
        let (done, idle) = (state.settling == 0, state.is_idle());
        drop(state);
        self.settling.fetch_sub(1, Ordering::AcqRel);
        if done {
            key.settled.notify_waiters();
        }
        if idle {
            self.forget_if_idle(advisory_key);
        }
    }

    /// Drops the key's entry if nothing is kept for it any more.
    fn forget_if_idle(&self, advisory_key: i64) {
        let mut keys = self.keys();
        if keys
            .get(&advisory_key)
            .is_some_and(|key| key.state().is_idle())
        {
            keys.remove(&advisory_key);
        }
    }

    /// Takes the grant kept for a wait of this kind, if there is one: the wait's lease. The
    /// wait no longer counts as waiting from then on (see [`close`](Self::close)).
    fn claim(
        self: &Arc<Self>,
        advisory_key: i64,
        key: &Arc<KeyWaits>,
        exclusive: bool,
    ) -> Option<Claimed> {
        let (grant, fencing_token) = {
            let mut state = key.state();
            if state.grant.as_ref()?.exclusive != exclusive {
                return None;
            }
            let grant = state.grant.take()?;
            self.busy.fetch_sub(1, Ordering::AcqRel);
            // A session that ended (or a token out of range, which the sequence never hands
            // out) is no lease: dropped, it closes, which frees whatever it held.
            let fencing_token = u64::try_from(grant.fencing_token)
                .ok()
                .filter(|_| !grant.waiting.session.is_closed())?;
            let waits = state.waits_mut(exclusive);
            *waits = waits.saturating_sub(1);
            (grant, fencing_token)
        };
        let hold = if exclusive {
            Advisory::Exclusive(advisory_key)
        } else {
            Advisory::Shared(advisory_key)
        };
        let (session, sent) = (grant.waiting.session.clone(), grant.sent);
        // Recorded before anything can fail: a session dropped with the hold on its books
        // closes, which frees the key.
        session.adopt(hold);
        let adopted = self.sessions.adopt(grant.waiting);
        // The waits of the other kind (if any) need a watcher of their own now.
        self.start_watcher(advisory_key, key);
        Some(Claimed {
            session,
            hold,
            fencing_token,
            adopted,
            sent,
        })
    }

    /// Unlocks a grant nobody took. Its session comes back clean if the server confirmed the
    /// unlock, and closes otherwise (which frees the key).
    async fn unlock_unclaimed(&self, advisory_key: i64, grant: Grant) {
        if unlock(&grant.waiting, advisory_key, grant.exclusive, self.timeout).await {
            self.sessions.keep(grant.waiting);
        }
    }
}

/// Unlocks `advisory_key` on `waiting`: `true` once the server confirmed it.
async fn unlock(
    waiting: &WaitingSession,
    advisory_key: i64,
    exclusive: bool,
    timeout: Duration,
) -> bool {
    let sql = if exclusive {
        super::UNLOCK
    } else {
        super::UNLOCK_SHARED
    };
    let params: [(&(dyn ToSql + Sync), Type); 1] = [(&advisory_key, Type::INT8)];
    // A withdrawal of the request that was granted (`pg_cancel_backend`, sent by a wait that
    // ended as the grant came) can reach the session while this unlock runs, and cancels it:
    // the unlock did not happen, so it is sent once more (a request is withdrawn only once).
    for _ in 0..2 {
        let unlock = waiting.session.client().query_typed_one(sql, &params);
        match crate::background::within(timeout, unlock).await {
            Some(Ok(row)) => return row.try_get::<_, bool>(0).unwrap_or(false),
            Some(Err(error)) if error.code() == Some(&SqlState::QUERY_CANCELED) => continue,
            Some(Err(_)) | None => return false,
        }
    }
    false
}

/// Withdraws the watch statement of the waiting session whose server process is `process`
/// from the server's lock queue: the wait function answers NULL at once. Sent on any lock
/// session, so no connection is opened for it; with none open, the statement ends with its
/// slice instead.
async fn withdraw(shared: Arc<WatchState>, process: i32) {
    let Some(session) = shared.lock_sessions.least_loaded() else {
        return;
    };
    let params: [(&(dyn ToSql + Sync), Type); 1] = [(&process, Type::INT4)];
    let cancel = session
        .client()
        .query_typed_one("SELECT pg_cancel_backend($1)", &params);
    // Unanswered or refused, the statement still ends with its slice.
    let _ = crate::background::within(shared.timeout, cancel).await;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::super::{PostgresBackend, PostgresOptions};
    use crate::backend::LockBackend;
    use crate::backend::{Wait, Woken};
    use crate::LockMode;

    fn unreachable_backend() -> Arc<PostgresBackend> {
        // Nothing listens on port 1 of loopback: connecting is refused at once.
        let options = PostgresOptions::new("postgres://nobody@127.0.0.1:1/none");
        Arc::new(PostgresBackend::new(options).expect("valid options"))
    }

    #[tokio::test]
    async fn a_watcher_that_cannot_connect_wakes_its_wait_and_no_new_one_starts() {
        let backend = unreachable_backend();
        let mut wait = backend.clone().wait("jobs/nightly", LockMode::Exclusive);
        let woken = tokio::time::timeout(Duration::from_secs(10), wait.changed())
            .await
            .expect("woken, so the waiter polls instead of waiting on a dead watcher");
        assert!(matches!(woken, Woken::Retry));
        let shared = &backend.inner.watchers.shared;
        assert_eq!(shared.busy.load(std::sync::atomic::Ordering::Acquire), 0);
        assert!(
            shared.sessions.connecting_fails(),
            "no new watcher for a while"
        );
        drop(wait);
        assert!(
            shared.keys().is_empty(),
            "an ended wait leaves nothing behind"
        );
    }

    #[tokio::test]
    async fn a_wait_that_ends_leaves_no_entry_behind() {
        let backend = unreachable_backend();
        let reader = backend.clone().wait("jobs/nightly", LockMode::Shared);
        let writer = backend.clone().wait("jobs/nightly", LockMode::Exclusive);
        let shared = &backend.inner.watchers.shared;
        assert_eq!(shared.keys().len(), 1, "one entry per key");
        drop((reader, writer));
        // The watcher (if one started) ends once it sees nobody waits.
        for _ in 0..200 {
            if shared.keys().is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the key's entry outlived its waits");
    }
}
