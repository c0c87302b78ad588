//! Waking another process's waiter the moment a lock is freed, at no cost to the release.
//!
//! Without this, a waiter in another process learns of a release only at its next attempt, up
//! to the maximum retry delay later. So for each key a process waits for, its backend keeps a
//! *watcher*: a session of its own (never one of the pool's) that queues for a shared lock on
//! the same advisory key. The server grants it the moment the lock is freed, however that
//! happens: an unlock by LockingKit or by plain SQL, or the holder's session ending (a crash,
//! `pg_terminate_backend`). The same statement gives the shared lock straight back, and the
//! watcher wakes the key's front waiter, which retries at once (see
//! [`LockBackend::release_hint`](crate::LockBackend::release_hint)). The release itself is a
//! plain `pg_advisory_unlock`: it pays nothing for this.
//!
//! - A watcher starts with the key's first wait and watches again only after its waiter's next
//!   attempt, so a lock that is free while attempts fail for another reason cannot spin it.
//! - When nobody waits for the key any more, the watcher closes its session, which also
//!   withdraws a request still queued; a process that waits for nothing keeps nothing open.
//! - At most [`MAX_WATCHERS`] keys are watched per backend at once; waits beyond that, and
//!   waits while the server cannot be reached, are served by polling, which stays the fallback
//!   and the cap in every case.
//! - The shared lock is held only for the instant between the grant and the end of the
//!   statement; an attempt of another process landing in that instant answers busy, and that
//!   process then watches too.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_postgres::Config;
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

/// Queues for a shared lock on the key and gives it back in the same statement: it returns
/// when the key is free. The subquery runs first, so the unlock follows the grant.
const WATCH: &str = "SELECT pg_advisory_unlock_shared($1::bigint) \
                     FROM (SELECT pg_advisory_lock_shared($1::bigint) OFFSET 0) granted";

/// The most keys one backend watches at once.
pub(super) const MAX_WATCHERS: usize = 16;

/// A watcher whose waiters all left keeps its session this long, for the next round of the
/// same wait (the engine subscribes anew before each attempt).
const GRACE: Duration = Duration::from_millis(100);

/// A watcher with no new attempt for this long stops, and an idle session this old closes.
const IDLE: Duration = Duration::from_secs(30);

/// How many open sessions a backend keeps for watchers to come.
const MAX_IDLE: usize = 2;

/// Keys nobody waits for are swept out once the map grows past this (and then past twice the
/// survivors), so memory follows the keys waited for now.
const FIRST_SWEEP: usize = 64;

/// After a watcher could not connect, no new one starts for this long.
const CONNECT_BACKOFF: Duration = Duration::from_secs(1);

/// The watchers of one backend and the waiters they wake.
pub(super) struct ReleaseWatch {
    shared: Arc<Shared>,
}

struct Shared {
    keys: Mutex<Keys>,
    config: Config,
    tls: MakeRustlsConnect,
    stop: CancellationToken,
}

#[derive(Default)]
struct Keys {
    by_key: HashMap<i64, Entry>,
    /// Open sessions no watcher uses, for the next one: connecting costs milliseconds.
    idle: Vec<WatchSession>,
    /// Entries nobody uses are swept out when the map grows past this.
    sweep_at: usize,
    watchers: usize,
    /// No watcher starts before this (set after a failed connect).
    quiet_until: Option<Instant>,
}

struct Entry {
    key: Arc<KeyWatch>,
    watched: bool,
}

struct KeyWatch {
    /// Wakes the key's waiters; its receivers are the waiters' hints.
    wake: watch::Sender<()>,
    /// Counts the attempts made under a hint: a watcher watches again only after a new one.
    attempts: watch::Sender<u64>,
}

impl ReleaseWatch {
    pub(super) fn new(config: Config, tls: MakeRustlsConnect) -> Self {
        ReleaseWatch {
            shared: Arc::new(Shared {
                keys: Mutex::new(Keys::default()),
                config,
                tls,
                stop: CancellationToken::new(),
            }),
        }
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
            shared.attempt_failed(advisory_key);
            if receiver.changed().await.is_err() {
                // The backend is gone: polling takes over.
                std::future::pending::<()>().await;
            }
        }
    }
}

impl Drop for ReleaseWatch {
    fn drop(&mut self) {
        self.shared.stop.cancel();
    }
}

impl Shared {
    fn keys(&self) -> MutexGuard<'_, Keys> {
        // Every critical section leaves the map consistent.
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A place among the key's waiters.
    fn waiter(&self, advisory_key: i64) -> watch::Receiver<()> {
        let mut keys = self.keys();
        if keys.by_key.len() >= keys.sweep_at.max(FIRST_SWEEP) {
            keys.by_key
                .retain(|_, entry| entry.watched || entry.key.wake.receiver_count() > 0);
            keys.sweep_at = keys.by_key.len() * 2;
        }
        keys.by_key
            .entry(advisory_key)
            .or_insert_with(|| Entry {
                key: Arc::new(KeyWatch {
                    wake: watch::channel(()).0,
                    attempts: watch::channel(0).0,
                }),
                watched: false,
            })
            .key
            .wake
            .subscribe()
    }

    /// A waiter's attempt answered busy: counts it, and starts the key's watcher if none runs.
    fn attempt_failed(self: &Arc<Self>, advisory_key: i64) {
        let runtime = tokio::runtime::Handle::try_current().ok();
        let mut keys = self.keys();
        let keys = &mut *keys;
        let Some(entry) = keys.by_key.get_mut(&advisory_key) else {
            return;
        };
        entry.key.attempts.send_modify(|attempts| *attempts += 1);
        let quiet = keys.quiet_until.is_some_and(|until| Instant::now() < until);
        if let (false, false, true, Some(runtime)) =
            (entry.watched, quiet, keys.watchers < MAX_WATCHERS, runtime)
        {
            entry.watched = true;
            keys.watchers += 1;
            runtime.spawn(watcher(self.clone(), advisory_key, entry.key.clone()));
        }
    }

    /// A watcher ended; `connect_failed` holds new watchers back for a while.
    fn watcher_ended(&self, advisory_key: i64, connect_failed: bool) {
        let mut keys = self.keys();
        keys.watchers = keys.watchers.saturating_sub(1);
        if connect_failed {
            keys.quiet_until = Some(Instant::now() + CONNECT_BACKOFF);
        }
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
enum End {
    /// Nobody waits any more, or the backend is gone; the session holds nothing and may serve
    /// another key.
    Clean(WatchSession),
    /// Nobody waits any more, but a request was still queued: the session must close.
    Done,
    /// The session could not be opened.
    ConnectFailed,
    /// The session failed.
    Failed,
}

/// A watcher's session. Dropping it closes the connection; the server then withdraws a
/// request still queued.
struct WatchSession {
    client: tokio_postgres::Client,
    driver: tokio::task::JoinHandle<()>,
    idle_since: Instant,
}

impl Drop for WatchSession {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Shared {
    /// An idle session that is still open, or a new one.
    async fn session(&self) -> Option<WatchSession> {
        loop {
            let idle = self.keys().idle.pop();
            match idle {
                Some(session)
                    if !session.client.is_closed() && session.idle_since.elapsed() < IDLE =>
                {
                    return Some(session)
                }
                Some(_) => continue,
                None => break,
            }
        }
        let connecting = tokio::select! {
            _ = self.stop.cancelled() => return None,
            connecting = self.config.connect(self.tls.clone()) => connecting,
        };
        let (client, connection) = connecting.ok()?;
        let driver = tokio::spawn(async move {
            let _ = connection.await;
        });
        Some(WatchSession {
            client,
            driver,
            idle_since: Instant::now(),
        })
    }

    /// Keeps a clean session for the next watcher, up to [`MAX_IDLE`].
    fn keep_idle(&self, mut session: WatchSession) {
        session.idle_since = Instant::now();
        let mut keys = self.keys();
        if keys.idle.len() < MAX_IDLE && !self.stop.is_cancelled() {
            keys.idle.push(session);
        }
    }
}

async fn watcher(shared: Arc<Shared>, advisory_key: i64, key: Arc<KeyWatch>) {
    let end = match shared.session().await {
        Some(session) => watch_key(&shared, session, &key, advisory_key).await,
        None if shared.stop.is_cancelled() => End::Done,
        None => End::ConnectFailed,
    };
    let connect_failed = matches!(end, End::ConnectFailed);
    match end {
        End::Clean(session) => shared.keep_idle(session),
        End::Done => {}
        End::ConnectFailed | End::Failed => {
            // The waiters may have been counting on us: let each look once, then poll.
            key.wake.send_replace(());
        }
    }
    shared.watcher_ended(advisory_key, connect_failed);
}

/// Whether the key's waiters are gone for good: not back within [`GRACE`] (the engine makes a
/// new hint before each attempt, so between two rounds of one wait there is briefly none).
async fn waiters_left(key: &KeyWatch) -> bool {
    if key.wake.receiver_count() > 0 {
        return false;
    }
    tokio::time::sleep(GRACE).await;
    key.wake.receiver_count() == 0
}

async fn watch_key(
    shared: &Shared,
    session: WatchSession,
    key: &KeyWatch,
    advisory_key: i64,
) -> End {
    let mut attempts = key.attempts.subscribe();
    // The attempt that started this watcher is the first one to watch for.
    let mut covered = attempts.borrow_and_update().saturating_sub(1);
    loop {
        // Wait for an attempt newer than the last wake-up.
        let newest = *attempts.borrow_and_update();
        if newest <= covered {
            tokio::select! {
                _ = shared.stop.cancelled() => return End::Done,
                changed = attempts.changed() => {
                    if changed.is_err() {
                        return End::Clean(session);
                    }
                }
                _ = key.wake.closed() => {
                    // A new attempt while we look whether the wait goes on is served at once.
                    tokio::select! {
                        left = waiters_left(key) => if left { return End::Clean(session) },
                        changed = attempts.changed() => {
                            if changed.is_err() {
                                return End::Clean(session);
                            }
                        }
                    }
                }
                _ = tokio::time::sleep(IDLE) => return End::Clean(session),
            }
            continue;
        }
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&advisory_key];
        let statement = session.client.query_one(WATCH, &params);
        tokio::pin!(statement);
        let freed = loop {
            tokio::select! {
                _ = shared.stop.cancelled() => break None,
                answer = &mut statement => break Some(answer.is_ok()),
                _ = key.wake.closed() => {
                    // The statement stays watched while we look whether the wait goes on.
                    tokio::select! {
                        answer = &mut statement => break Some(answer.is_ok()),
                        left = waiters_left(key) => if left { break None },
                    }
                }
            }
        };
        match freed {
            // Still queued: only closing the session withdraws the request.
            None => return End::Done,
            Some(false) => return End::Failed,
            Some(true) => {
                covered = newest;
                key.wake.send_replace(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PostgresBackend, PostgresOptions};
    use crate::LockBackend;
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
        let hint = backend.release_hint("jobs/nightly");
        tokio::task::yield_now().await;
        assert_eq!(backend.releases.shared.keys().watchers, 0);
        drop(hint);
    }

    #[tokio::test]
    async fn a_watcher_that_cannot_connect_wakes_its_waiter_and_holds_new_ones_back() {
        let backend = unreachable_backend();
        let hint = backend.release_hint("jobs/nightly");
        tokio::time::timeout(Duration::from_secs(10), hint)
            .await
            .expect("woken, so the waiter polls instead of waiting on a dead watcher");
        let keys = backend.releases.shared.keys();
        assert_eq!(keys.watchers, 0);
        assert!(keys.quiet_until.is_some(), "no new watcher for a while");
    }
}
