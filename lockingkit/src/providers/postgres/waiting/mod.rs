//! Waiting for a key another session holds: the server's lock queue hands the key to this
//! process's waiter the moment it is free, and the lock the server grants *is* the waiter's.
//!
//! Without this, a waiter in another process learns of a release only at its next attempt, up
//! to the maximum retry delay later, and a reader or writer that asks at the right moment gets
//! in ahead of it. So for each key a process waits for, its backend keeps a *watcher*: a
//! waiting session of its own (never a lock session, whose pipelined statements would queue
//! behind it) that queues for the same advisory key in the server's lock queue. The server
//! grants it the moment the key is free for it, however that happens: an unlock by LockingKit
//! or by plain SQL, or the holder's session ending (a crash, `pg_terminate_backend`). The
//! statement that waited keeps the lock and takes its fencing token in the same round trip
//! (see `slice`), and the watcher parks this *grant* for the waiter and wakes it; the waiter's
//! next attempt (see [`Watchers::claim`]) takes the grant instead of asking the server, so no
//! gap lies between the grant and the take. The lease then lives on the waiting session as on
//! any lock session: the session's periodic check, loss when it ends, release by the normal
//! unlock, the unconfirmed-unlock protocol. Once the lease is gone, a clean session comes back
//! for the next wait (see `waiting_session`).
//!
//! # Writers and readers
//! A watcher queues *exclusively* while a writer (or plain lock) of this process waits for the
//! key, from its first busy answer to the end of its wait — a wake-up does not clear it — and
//! *shared* while only readers wait. An exclusive grant is parked for writers and wakes only
//! them; a shared one for readers. Queued exclusively, the request is the writer's intent,
//! which every reader respects: the server refuses a `pg_try_advisory_lock_shared` that
//! conflicts with a *queued* request, and queues a blocking `pg_advisory_lock_shared` behind it
//! (a LockingKit session that already reads the key looks for a queued writer itself, since
//! the server would grant it without looking). So from the moment a writer's watcher queues,
//! no new reader gets in anywhere, and the server grants the writer the key once the readers
//! holding then are gone. The intent lapses only between two slices (one round trip), and a
//! blocking reader that queued behind a slice is granted when that slice ends unanswered; so
//! against readers that each hold the key longer than a slice, the writer waits for them too.
//!
//! # Costing the server nothing lasting
//! A statement that waits in a lock queue keeps a snapshot (`backend_xmin`) for as long as it
//! waits: VACUUM cannot remove rows that died after it, and CREATE INDEX CONCURRENTLY waits for
//! it — and deadlocks against a holder that runs one. So a watcher never waits long in one
//! statement: each waits at most [`SLICE`] (or half the server's `deadlock_timeout`, if that is
//! shorter) under `lock_timeout`, and one that times out is sent again at once. Each snapshot
//! lives at most one slice; the deadlock detector, which looks only after `deadlock_timeout`,
//! finds the wait already gone. A release between two slices is seen by the next one, which is
//! granted at once, so nothing is missed. A slice is one call of the wait function (see
//! `schema`), which catches the timeout, so the server logs nothing; without the function (a
//! role that may not create it, and nobody did) it is a plain statement whose timeout the
//! server logs as an ERROR.
//!
//! - A watcher starts with the first busy answer of a wait, and ends once its grant is claimed
//!   or nobody waits any more; the next busy answer starts the next one. It never sends a
//!   statement after its grant, so nothing of this process stays queued behind its waiter's
//!   hold (such a statement would be granted at the waiter's release and hold the key for
//!   nobody).
//! - A grant nobody waits for is unlocked at once; one nobody claims is unlocked when the
//!   waiters of its mode have left (not back within [`GONE`]: the engine makes a new hint
//!   before each attempt, so between two rounds of one wait there is briefly none), or at the
//!   latest a slice after the wake-up.
//! - When nobody waits for the key any more (not back within [`GONE`]), the watcher closes its
//!   session if a statement is still queued (the server drops it when the slice ends) or keeps
//!   it idle briefly for another wait; a process that waits for nothing keeps nothing open.
//! - At most `max_wait_sessions` waiting sessions are busy per backend at once, watching or
//!   holding a claimed grant; waits beyond that, and waits while the server cannot be reached
//!   (waiting sessions open through the backend's shared reconnect backoff, see `reconnect`),
//!   are served by polling, which stays the fallback and the cap in every case.
//! - A queued watcher never waits long enough for the deadlock detector to look at it, and a
//!   waiting session that holds a grant waits for nothing, so neither can take part in a
//!   deadlock.

mod slice;
mod waiting_session;
mod watcher;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{watch as channel, Notify};
use tokio_util::sync::CancellationToken;

use super::schema::Schema;
use super::session::{Advisory, Session, SessionSettings};
pub(super) use waiting_session::Adopted;
use waiting_session::{WaitingSession, WaitingSessions};

/// Waiters of a key not back within this have left: the engine makes a new hint before each
/// attempt, in the same poll that dropped the last one, so between two rounds of one wait there
/// is none only for an instant; this is that instant with room for a loaded machine.
const GONE: Duration = Duration::from_millis(20);

/// Keys nobody waits for are swept out once the map grows past this (and then past twice the
/// survivors), so memory follows the keys waited for now.
const FIRST_SWEEP: usize = 64;

/// The watchers of one backend, the waiters they wake, and the grants they keep for them.
pub(super) struct Watchers {
    shared: Arc<WatchState>,
}

struct WatchState {
    keys: Mutex<Keys>,
    stop: CancellationToken,
    /// The most waiting sessions busy at once (`max_wait_sessions`).
    max_watchers: usize,
    sessions: Arc<WaitingSessions>,
    /// The statement timeout: how long a watch statement may go unanswered beyond its slice
    /// before its session is considered broken, and the limit of an unlock.
    timeout: Duration,
}

#[derive(Default)]
struct Keys {
    by_key: HashMap<i64, WatchedKey>,
    /// Entries nobody uses are swept out when the map grows past this.
    sweep_at: usize,
    watchers: usize,
}

struct WatchedKey {
    key: Arc<KeyWaiters>,
    watched: bool,
}

/// The waiters of one key in this process, and the grant kept for them.
struct KeyWaiters {
    /// Wakes the key's waiting writers (and plain locks); its receivers are their hints.
    writers: channel::Sender<()>,
    /// Wakes the key's waiting readers.
    readers: channel::Sender<()>,
    /// Told when a waiter takes a place, so a watcher that looks whether the wait goes on
    /// learns at once.
    arrived: Notify,
    /// A writer's attempt answered busy, and its wait has not ended: slices queue exclusively.
    writer_waits: AtomicBool,
    /// What the server granted the watcher, until a waiter's attempt claims it.
    grant: Mutex<Option<Grant>>,
    /// Told when the grant is claimed.
    claimed: Notify,
}

/// A lock the server granted a waiting session for this process's waiters.
struct Grant {
    waiting: WaitingSession,
    exclusive: bool,
    fencing_token: i64,
}

/// A grant an attempt took: the lease's lock, on the waiting session it was granted to.
pub(super) struct Claimed {
    pub(super) session: Arc<Session>,
    pub(super) hold: Advisory,
    pub(super) fencing_token: u64,
    pub(super) adopted: Adopted,
}

impl Watchers {
    pub(super) fn new(
        settings: Arc<SessionSettings>,
        max_watchers: usize,
        schema: Arc<Schema>,
    ) -> Self {
        let timeout = settings.timeout;
        Watchers {
            shared: Arc::new(WatchState {
                keys: Mutex::new(Keys::default()),
                stop: CancellationToken::new(),
                max_watchers,
                sessions: Arc::new(WaitingSessions::new(settings, schema)),
                timeout,
            }),
        }
    }

    /// An exclusive attempt on `advisory_key` (a writer's, or a plain lock's) answered busy:
    /// if a writer waits for the key, its watcher queues exclusively from now until the
    /// writers have left. See "Writers and readers" above.
    pub(super) fn writer_busy(&self, advisory_key: i64) {
        if let Some(entry) = self.shared.keys().by_key.get(&advisory_key) {
            entry.key.writer_waits.store(true, Ordering::Release);
        }
    }

    /// Waiting sessions open now: watching, holding a claimed grant, or idle.
    pub(super) fn sessions(&self) -> usize {
        self.shared.sessions.open()
    }

    /// Resolves when the server granted `advisory_key` to this process's watcher for a waiter
    /// of this kind (`exclusive`: writers and plain locks), or the watcher stopped; never
    /// resolves if the key is not watched.
    ///
    /// The engine makes this before an attempt and polls it only after the attempt answered
    /// busy, so the watcher starts on the first poll: an attempt that wins never opens a
    /// waiting session. Starting late misses nothing, because the watcher asks the server
    /// for the key *now*: a release in between makes it answer at once. The waiter's place is
    /// taken at once, though, so the watcher of a continuing wait does not see the wait end
    /// between two attempts.
    pub(super) fn subscribe(
        &self,
        advisory_key: i64,
        exclusive: bool,
    ) -> impl Future<Output = ()> + Send + 'static {
        let mut receiver = self.shared.waiter(advisory_key, exclusive);
        let shared = self.shared.clone();
        async move {
            shared.answered_busy(advisory_key);
            if receiver.changed().await.is_err() {
                // The backend is gone: polling takes over.
                std::future::pending::<()>().await;
            }
        }
    }

    /// The grant of `advisory_key` kept for an attempt of this kind, if there is one: the
    /// attempt takes it as its lock, with the fencing token the grant came with.
    pub(super) fn claim(&self, advisory_key: i64, exclusive: bool) -> Option<Claimed> {
        let key = self.shared.keys().by_key.get(&advisory_key)?.key.clone();
        let grant = {
            let mut grant = key.grant();
            if grant.as_ref()?.exclusive != exclusive {
                return None;
            }
            grant.take()?
        };
        key.claimed.notify_waiters();
        let hold = if exclusive {
            Advisory::Exclusive(advisory_key)
        } else {
            Advisory::Shared(advisory_key)
        };
        let session = grant.waiting.session.clone();
        // Recorded before anything can fail: a session dropped with the hold on its books
        // closes, which frees the key.
        session.adopt(hold);
        let adopted = self.shared.sessions.adopt(grant.waiting);
        if session.is_closed() {
            return None;
        }
        Some(Claimed {
            session,
            hold,
            fencing_token: u64::try_from(grant.fencing_token).ok()?,
            adopted,
        })
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

impl KeyWaiters {
    fn new() -> Self {
        KeyWaiters {
            writers: channel::channel(()).0,
            readers: channel::channel(()).0,
            arrived: Notify::new(),
            writer_waits: AtomicBool::new(false),
            grant: Mutex::new(None),
            claimed: Notify::new(),
        }
    }

    fn grant(&self) -> MutexGuard<'_, Option<Grant>> {
        // Every critical section leaves the slot consistent.
        self.grant.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn waiters(&self, exclusive: bool) -> &channel::Sender<()> {
        if exclusive {
            &self.writers
        } else {
            &self.readers
        }
    }

    /// Whether anyone waits for the key.
    fn in_use(&self) -> bool {
        self.writers.receiver_count() > 0 || self.readers.receiver_count() > 0
    }

    /// Whether waiters of this kind are here, or come back within [`GONE`].
    async fn stay(&self, exclusive: bool) -> bool {
        let waiters = self.waiters(exclusive);
        let deadline = crate::clock::in_(GONE);
        loop {
            let arrived = self.arrived.notified();
            let mut arrived = std::pin::pin!(arrived);
            arrived.as_mut().enable();
            if waiters.receiver_count() > 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, arrived).await.is_err() {
                return waiters.receiver_count() > 0;
            }
        }
    }

    /// How the next slice queues: `Some(true)` exclusively for waiting writers, `Some(false)`
    /// shared for readers, `None` when nobody waits any more.
    async fn wanted(&self) -> Option<bool> {
        if self.writer_waits.load(Ordering::Acquire) {
            if self.stay(true).await {
                return Some(true);
            }
            // The writers' wait ended: the intent goes with it.
            self.writer_waits.store(false, Ordering::Release);
        }
        if self.stay(false).await {
            return Some(false);
        }
        // A writer whose first busy answer came while we looked.
        (self.writers.receiver_count() > 0).then_some(true)
    }

    /// Resolves once waiters of this kind have left (see [`stay`](Self::stay)).
    async fn left(&self, exclusive: bool) {
        loop {
            self.waiters(exclusive).closed().await;
            if !self.stay(exclusive).await {
                return;
            }
        }
    }

    /// Resolves once nobody waits for the key any more.
    async fn all_left(&self) {
        loop {
            self.writers.closed().await;
            self.readers.closed().await;
            if !self.stay(true).await && !self.stay(false).await {
                return;
            }
        }
    }
}

impl WatchState {
    fn keys(&self) -> MutexGuard<'_, Keys> {
        // Every critical section leaves the map consistent.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place among the key's waiters of this kind.
    fn waiter(&self, advisory_key: i64, exclusive: bool) -> channel::Receiver<()> {
        let mut keys = self.keys();
        if keys.by_key.len() >= keys.sweep_at.max(FIRST_SWEEP) {
            keys.by_key
                .retain(|_, entry| entry.watched || entry.key.in_use());
            keys.sweep_at = keys.by_key.len() * 2;
        }
        let key = &keys
            .by_key
            .entry(advisory_key)
            .or_insert_with(|| WatchedKey {
                key: Arc::new(KeyWaiters::new()),
                watched: false,
            })
            .key;
        let receiver = key.waiters(exclusive).subscribe();
        key.arrived.notify_waiters();
        receiver
    }

    /// A waiter's attempt answered busy: starts the key's watcher if none runs and the budget
    /// of waiting sessions has room.
    fn answered_busy(self: &Arc<Self>, advisory_key: i64) {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let mut keys = self.keys();
        let keys = &mut *keys;
        let busy = keys.watchers.saturating_add(self.sessions.adopted());
        let Some(entry) = keys.by_key.get_mut(&advisory_key) else {
            return;
        };
        // While connecting fails, waiters poll: a watcher could not connect either.
        let quiet = self.sessions.connecting_fails();
        if let (false, false, true, Some(runtime)) =
            (entry.watched, quiet, busy < self.max_watchers, runtime)
        {
            entry.watched = true;
            keys.watchers += 1;
            runtime.spawn(watcher::watcher(
                self.clone(),
                advisory_key,
                entry.key.clone(),
            ));
        }
    }

    /// A watcher ended.
    fn watcher_ended(&self, advisory_key: i64) {
        let mut keys = self.keys();
        keys.watchers = keys.watchers.saturating_sub(1);
        if let std::collections::hash_map::Entry::Occupied(mut entry) =
            keys.by_key.entry(advisory_key)
        {
            if entry.get().key.in_use() {
                entry.get_mut().watched = false;
            } else {
                entry.remove();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PostgresBackend, PostgresOptions};
    use crate::providers::hinted::Hints;
    use crate::LockMode;
    use std::time::Duration;

    fn unreachable_backend() -> PostgresBackend {
        // Nothing listens on port 1 of loopback: connecting is refused at once.
        PostgresBackend::new(PostgresOptions::new("postgres://nobody@127.0.0.1:1/none"))
            .expect("valid options")
    }

    #[tokio::test]
    async fn a_hint_that_is_never_polled_starts_no_watcher() {
        let backend = unreachable_backend();
        // The engine makes a hint before every attempt and polls it only after a busy answer.
        let hint = backend.hint("jobs/nightly", LockMode::Exclusive);
        tokio::task::yield_now().await;
        assert_eq!(backend.inner.watchers.shared.keys().watchers, 0);
        drop(hint);
    }

    #[tokio::test]
    async fn a_watcher_that_cannot_connect_wakes_its_waiter_and_holds_new_ones_back() {
        let backend = unreachable_backend();
        let hint = backend.hint("jobs/nightly", LockMode::Exclusive);
        tokio::time::timeout(Duration::from_secs(10), hint)
            .await
            .expect("woken, so the waiter polls instead of waiting on a dead watcher");
        let keys = backend.inner.watchers.shared.keys();
        assert_eq!(keys.watchers, 0);
        assert!(
            backend.inner.watchers.shared.sessions.connecting_fails(),
            "no new watcher for a while"
        );
    }
}
