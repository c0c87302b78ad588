//! Waking another process's waiter the moment a lock is freed, at no lasting cost to the server.
//!
//! Without this, a waiter in another process learns of a release only at its next attempt, up
//! to the maximum retry delay later. So for each key a process waits for, its backend keeps a
//! *watcher*: a session of its own (never one that holds locks) that queues for an exclusive
//! lock on the same advisory key. The server grants it the moment the key is free of every
//! holder, however that happens: an unlock by LockingKit or by plain SQL, or the holder's
//! session ending (a crash, `pg_terminate_backend`). The same statement gives the lock straight
//! back, and the watcher wakes the key's front waiter, which retries at once (see
//! [`LockBackend::release_hint`](crate::LockBackend::release_hint)). The release itself is a
//! plain `pg_advisory_unlock`: it pays nothing for this.
//!
//! # Writers and readers
//! A watcher queues *exclusively* while a writer of this process waits for the key (an
//! exclusive attempt answered busy since the watcher last woke its waiters), and *shared* while
//! only readers wait. A shared request would be granted at once while readers hold the key,
//! waking a writer that waits for them over and over; an exclusive one, queued for a reader that
//! waits behind a writer, would hold every other reader back until the readers holding have all
//! gone, as if a writer waited.
//!
//! Queued exclusive, the request is also the waiting writer's intent, which new readers respect:
//! the server
//! refuses a new `pg_try_advisory_lock_shared` that conflicts with a *queued* request, not only
//! with granted ones. So from the moment a writer's watcher queues, no new reader gets in
//! anywhere (a LockingKit session that already reads the key looks for a queued writer itself,
//! since the server would grant it without looking), and the writer gets in once the readers
//! holding then are gone. The intent lapses briefly between two slices, and between the grant
//! and the writer's attempt; a reader landing there gets in, and the writer waits for it too.
//!
//! # Costing the server nothing lasting
//! A statement that waits in a lock queue keeps a snapshot (`backend_xmin`) for as long as it
//! waits: VACUUM cannot remove rows that died after it, and CREATE INDEX CONCURRENTLY waits for
//! it — and deadlocks against a holder that runs one. So a watcher never waits long in one
//! statement: each waits at most [`SLICE`] (or half the server's `deadlock_timeout`, if that is
//! shorter) under `lock_timeout`, and one that times out is sent again at once. Each snapshot
//! lives at most one slice; the deadlock detector, which looks only after `deadlock_timeout`,
//! finds the wait already gone. A release between two slices is seen by the next one, which is
//! granted at once, so nothing is missed. A slice is one call of the watch function (see
//! `schema`), which catches the timeout, so the server logs nothing; without the function (a
//! role that may not create it, and nobody did) it is a plain statement whose timeout the
//! server logs as an ERROR.
//!
//! - A watcher starts with the key's first wait and watches again only after its waiter's next
//!   attempt, so a lock that is free while attempts fail for another reason cannot spin it.
//! - When nobody waits for the key any more, the watcher closes its session if a statement is
//!   still queued (the server drops it when the slice ends) or keeps it idle for [`LINGER`]
//!   for another wait; a process that waits for nothing keeps nothing open.
//! - At most `max_wait_sessions` keys are watched per backend at once; waits beyond that, and
//!   waits while the server cannot be reached (watchers connect through the backend's shared
//!   reconnect backoff, see `reconnect`), are served by polling, which stays the fallback and
//!   the cap in every case.
//! - The lock is held only for the instant between the grant and the end of the statement; an
//!   attempt of another process landing in that instant answers busy, and that process then
//!   watches too. A queued watcher never waits long enough for the deadlock detector to look at
//!   it, and holds nothing while it waits, so it cannot take part in a deadlock.

mod slice;
mod waiting_session;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch as channel;
use tokio_util::sync::CancellationToken;

use super::schema::Schema;
use super::session::SessionSettings;
use slice::SLICE;
use waiting_session::{WaitingSession, WaitingSessions, LINGER};

/// A watcher with no new attempt for this long stops.
const IDLE: Duration = Duration::from_secs(30);

/// Keys nobody waits for are swept out once the map grows past this (and then past twice the
/// survivors), so memory follows the keys waited for now.
const FIRST_SWEEP: usize = 64;

/// The watchers of one backend and the waiters they wake.
pub(super) struct Watchers {
    shared: Arc<WatchState>,
}

struct WatchState {
    keys: Mutex<Keys>,
    stop: CancellationToken,
    /// The most keys watched at once (`max_wait_sessions`).
    max_watchers: usize,
    sessions: Arc<WaitingSessions>,
    /// How long a watch statement may go unanswered beyond its slice before its session is
    /// considered broken: the statement timeout.
    overdue: Duration,
}

#[derive(Default)]
struct Keys {
    by_key: HashMap<i64, WatchedKey>,
    /// Entries nobody uses are swept out when the map grows past this.
    sweep_at: usize,
    watchers: usize,
}

struct WatchedKey {
    key: Arc<KeyWatch>,
    watched: bool,
}

struct KeyWatch {
    /// Wakes the key's waiters; its receivers are the waiters' hints.
    wake: channel::Sender<()>,
    /// Counts the attempts made under a hint: a watcher watches again only after a new one.
    attempts: channel::Sender<u64>,
    /// An exclusive attempt answered busy since the watcher last woke the waiters: a writer
    /// waits, so the watcher queues exclusively.
    writer_waits: AtomicBool,
}

impl Watchers {
    pub(super) fn new(
        settings: Arc<SessionSettings>,
        max_watchers: usize,
        schema: Arc<Schema>,
    ) -> Self {
        let overdue = settings.timeout;
        Watchers {
            shared: Arc::new(WatchState {
                keys: Mutex::new(Keys::default()),
                stop: CancellationToken::new(),
                max_watchers,
                sessions: Arc::new(WaitingSessions::new(settings, schema)),
                overdue,
            }),
        }
    }

    /// An exclusive attempt on `advisory_key` (a writer's, or a plain lock's) answered busy.
    /// See "Writers and readers" above.
    pub(super) fn writer_busy(&self, advisory_key: i64) {
        self.shared.writer_busy(advisory_key);
    }

    /// Sessions open for watchers now, busy or idle.
    pub(super) fn sessions(&self) -> usize {
        self.shared.sessions.open()
    }

    /// Resolves when `advisory_key` may have been freed; never resolves if the key is not
    /// watched.
    ///
    /// The engine makes this before an attempt and polls it only after the attempt answered
    /// busy, so the watcher starts on the first poll: an attempt that wins never opens a
    /// watcher session. Starting late misses nothing, because the watcher asks the server
    /// whether the key is free *now*: a release in between makes it answer at once. The
    /// waiter's place is taken at once, though, so the watcher of a continuing wait does not
    /// see the wait end between two attempts.
    pub(super) fn subscribe(&self, advisory_key: i64) -> impl Future<Output = ()> + Send + 'static {
        let mut receiver = self.shared.waiter(advisory_key);
        let shared = self.shared.clone();
        async move {
            shared.answered_busy(advisory_key);
            if receiver.changed().await.is_err() {
                // The backend is gone: polling takes over.
                std::future::pending::<()>().await;
            }
        }
    }
}

impl Watchers {
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
    fn keys(&self) -> MutexGuard<'_, Keys> {
        // Every critical section leaves the map consistent.
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A place among the key's waiters.
    fn waiter(&self, advisory_key: i64) -> channel::Receiver<()> {
        let mut keys = self.keys();
        if keys.by_key.len() >= keys.sweep_at.max(FIRST_SWEEP) {
            keys.by_key
                .retain(|_, entry| entry.watched || entry.key.wake.receiver_count() > 0);
            keys.sweep_at = keys.by_key.len() * 2;
        }
        keys.by_key
            .entry(advisory_key)
            .or_insert_with(|| WatchedKey {
                key: Arc::new(KeyWatch {
                    wake: channel::channel(()).0,
                    attempts: channel::channel(0).0,
                    writer_waits: AtomicBool::new(false),
                }),
                watched: false,
            })
            .key
            .wake
            .subscribe()
    }

    /// An exclusive attempt on `advisory_key` answered busy. Called before the waiter polls its
    /// hint, so a watcher that starts or watches again for it already knows a writer waits.
    fn writer_busy(&self, advisory_key: i64) {
        if let Some(entry) = self.keys().by_key.get(&advisory_key) {
            entry.key.writer_waits.store(true, Ordering::Release);
        }
    }

    /// A waiter's attempt answered busy: counts it, and starts the key's watcher if none runs.
    fn answered_busy(self: &Arc<Self>, advisory_key: i64) {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let mut keys = self.keys();
        let keys = &mut *keys;
        let Some(entry) = keys.by_key.get_mut(&advisory_key) else {
            return;
        };
        entry.key.attempts.send_modify(|attempts| *attempts += 1);
        // While connecting fails, waiters poll: a watcher could not connect either.
        let quiet = self.sessions.connecting_fails();
        if let (false, false, true, Some(runtime)) = (
            entry.watched,
            quiet,
            keys.watchers < self.max_watchers,
            runtime,
        ) {
            entry.watched = true;
            keys.watchers += 1;
            runtime.spawn(watcher(self.clone(), advisory_key, entry.key.clone()));
        }
    }

    /// A watcher ended.
    fn watcher_ended(&self, advisory_key: i64) {
        let mut keys = self.keys();
        keys.watchers = keys.watchers.saturating_sub(1);
        if let std::collections::hash_map::Entry::Occupied(mut entry) =
            keys.by_key.entry(advisory_key)
        {
            if entry.get().key.wake.receiver_count() == 0 {
                entry.remove();
            } else {
                entry.get_mut().watched = false;
            }
        }
    }
}

/// Why a watcher stopped.
enum WatcherExit {
    /// Nobody waits any more, or the backend is gone; the session holds nothing and may serve
    /// another key.
    Clean(Box<WaitingSession>),
    /// Nobody waits any more, but a request was still queued: the session must close.
    Done,
    /// The session could not be opened.
    ConnectFailed,
    /// The session failed.
    Failed,
}

async fn watcher(shared: Arc<WatchState>, advisory_key: i64, key: Arc<KeyWatch>) {
    let end = match shared.sessions.take().await {
        Some(session) => watch_key(&shared, session, &key, advisory_key).await,
        None if shared.stop.is_cancelled() => WatcherExit::Done,
        None => WatcherExit::ConnectFailed,
    };
    match end {
        WatcherExit::Clean(session) => shared.sessions.keep(*session),
        WatcherExit::Done => {}
        WatcherExit::ConnectFailed | WatcherExit::Failed => {
            // The waiters may have been counting on us: let each look once, then poll.
            key.wake.send_replace(());
        }
    }
    shared.watcher_ended(advisory_key);
}

/// Whether the key's waiters are gone for good: not back within [`LINGER`] (the engine makes a
/// new hint before each attempt, so between two rounds of one wait there is briefly none).
async fn waiters_left(key: &KeyWatch) -> bool {
    if key.wake.receiver_count() > 0 {
        return false;
    }
    tokio::time::sleep(LINGER).await;
    key.wake.receiver_count() == 0
}

async fn watch_key(
    shared: &WatchState,
    session: WaitingSession,
    key: &KeyWatch,
    advisory_key: i64,
) -> WatcherExit {
    let mut attempts = key.attempts.subscribe();
    // The attempt that started this watcher is the first one to watch for.
    let mut covered = attempts.borrow_and_update().saturating_sub(1);
    loop {
        // Wait for an attempt newer than the last wake-up.
        let newest = *attempts.borrow_and_update();
        if newest <= covered {
            tokio::select! {
                _ = shared.stop.cancelled() => return WatcherExit::Done,
                changed = attempts.changed() => {
                    if changed.is_err() {
                        return WatcherExit::Clean(Box::new(session));
                    }
                }
                _ = key.wake.closed() => {
                    // A new attempt while we look whether the wait goes on is served at once.
                    tokio::select! {
                        left = waiters_left(key) => if left { return WatcherExit::Clean(Box::new(session)) },
                        changed = attempts.changed() => {
                            if changed.is_err() {
                                return WatcherExit::Clean(Box::new(session));
                            }
                        }
                    }
                }
                _ = tokio::time::sleep(IDLE) => return WatcherExit::Clean(Box::new(session)),
            }
            continue;
        }
        match watch_until_free(shared, &session, key, advisory_key).await {
            Slices::Freed => {
                covered = newest;
                // A writer still waiting says so again with its next busy attempt.
                key.writer_waits.store(false, Ordering::Release);
                key.wake.send_replace(());
            }
            Slices::Left => return WatcherExit::Clean(Box::new(session)),
            // Still queued: closing the session ends the request when its slice does.
            Slices::LeftQueued => return WatcherExit::Done,
            Slices::Failed => return WatcherExit::Failed,
        }
    }
}

/// How a run of watch statements ended.
enum Slices {
    /// The key was free.
    Freed,
    /// Nobody waits any more; nothing is queued.
    Left,
    /// Nobody waits any more, and a statement is still queued.
    LeftQueued,
    /// The session failed, or a statement stayed unanswered well past its slice.
    Failed,
}

/// Sends watch statements, one slice after another, until one finds the key free or nobody
/// waits any more.
async fn watch_until_free(
    shared: &WatchState,
    session: &WaitingSession,
    key: &KeyWatch,
    advisory_key: i64,
) -> Slices {
    loop {
        if key.wake.receiver_count() == 0 && waiters_left(key).await {
            return Slices::Left;
        }
        let exclusive = key.writer_waits.load(Ordering::Acquire);
        let statement = session
            .slices
            .wait_one(session.session.client(), advisory_key, exclusive);
        tokio::pin!(statement);
        let overdue = tokio::time::sleep(SLICE + shared.overdue);
        tokio::pin!(overdue);
        let answer = loop {
            tokio::select! {
                _ = shared.stop.cancelled() => return Slices::LeftQueued,
                answer = &mut statement => break answer,
                _ = key.wake.closed() => {
                    // The statement stays watched while we look whether the wait goes on.
                    tokio::select! {
                        answer = &mut statement => break answer,
                        left = waiters_left(key) => if left { return Slices::LeftQueued },
                    }
                }
                _ = &mut overdue => return Slices::Failed,
            }
        };
        match answer {
            Ok(true) => return Slices::Freed,
            // The slice ended with the key still taken: the next one queues again.
            Ok(false) => {}
            Err(_) => return Slices::Failed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PostgresBackend, PostgresOptions};
    use crate::{LockBackend, LockMode};
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
        let hint = backend.release_hint("jobs/nightly", LockMode::Exclusive);
        tokio::task::yield_now().await;
        assert_eq!(backend.inner.watchers.shared.keys().watchers, 0);
        drop(hint);
    }

    #[tokio::test]
    async fn a_watcher_that_cannot_connect_wakes_its_waiter_and_holds_new_ones_back() {
        let backend = unreachable_backend();
        let hint = backend.release_hint("jobs/nightly", LockMode::Exclusive);
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
