//! Release notifications: waking another process's waiter the moment a lock is released.
//!
//! Without them, a waiter in another process learns of a release only at its next attempt,
//! up to the maximum retry delay later. So each backend keeps one session of its own that
//! `LISTEN`s on the channel `lockingkit` and wakes the waiters of a key when a notification
//! with its advisory key arrives (see
//! [`LockBackend::release_hint`](crate::LockBackend::release_hint)).
//!
//! A notification costs the releasing server more than the unlock itself, so a release sends
//! one only when some process waits for the key. A waiting process says so with a *waiter
//! mark*: its listener session holds a shared advisory lock on the key's two-`int4` twin
//! ([`waiter_mark`]), which never meets the single-`bigint` lock keys. The unlock statement
//! tries that twin exclusively after unlocking; it fails only while some listener holds the
//! mark, and only then does the statement `NOTIFY`. A mark is taken when a key gets its first
//! waiter and given up within [`SWEEP`] after the last one leaves.
//!
//! The listener is a hint, never a guarantee, so polling stays the fallback and the cap:
//! - it starts on the first wait, not with the backend, so a backend that never waits never
//!   opens the extra session; it never uses a lock connection of the pool;
//! - a release between a waiter's failed attempt and its mark being confirmed sends no
//!   notification, so the waiter is woken once when its mark is confirmed and looks again;
//! - while the listener is down (not yet connected, or reconnecting with backoff) nobody is
//!   woken; when it comes back every waiter is woken once, since releases may have been missed;
//! - a lock freed because its holder's session ended (a crash, `pg_terminate_backend`, a
//!   network loss) sends no notification: NOTIFY runs only in a live session, so such
//!   hand-offs wait for the next attempt;
//! - the payload is the advisory key (a hash, as `pg_locks` shows it), never the lock key.

use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio_postgres::{AsyncMessage, Client, Config};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

/// Every LockingKit backend on a database shares the channel `lockingkit`.
const LISTEN: &str = "LISTEN lockingkit";

/// Takes a waiter mark without waiting: a releaser holds the mark exclusively for the instant
/// of its unlock statement, and a mark refused then is retried at the next sweep.
const MARK: &str = "SELECT pg_try_advisory_lock_shared($1::int4, $2::int4)";
const UNMARK: &str = "SELECT pg_advisory_unlock_shared($1::int4, $2::int4)";

/// How often a listener holding marks gives up those of keys nobody waits for any more, and
/// retries marks that were refused.
pub(super) const SWEEP: Duration = Duration::from_secs(1);

/// A listener statement that takes longer than this ends the session (which drops its marks);
/// it reconnects with backoff.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Reconnection backoff of the listener: a dead server is retried without hammering it.
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(5);

/// While the listener is down, keys without waiters are swept out once the map grows past
/// this (and then past twice the survivors), so memory follows the keys waited on now.
const FIRST_SWEEP: usize = 64;

/// The two-`int4` advisory key whose shared holders are the processes waiting for
/// `advisory_key`: its high and low 32 bits.
pub(super) fn waiter_mark(advisory_key: i64) -> (i32, i32) {
    ((advisory_key >> 32) as i32, advisory_key as i32)
}

/// The listener of one backend and the waiters it wakes.
pub(super) struct ReleaseWatch {
    waiters: Arc<Waiters>,
    started: AtomicBool,
    stop: CancellationToken,
    config: Config,
    tls: MakeRustlsConnect,
}

impl ReleaseWatch {
    pub(super) fn new(config: Config, tls: MakeRustlsConnect) -> Self {
        ReleaseWatch {
            waiters: Arc::new(Waiters::default()),
            started: AtomicBool::new(false),
            stop: CancellationToken::new(),
            config,
            tls,
        }
    }

    /// Resolves at the next release notification for `advisory_key` after this call (or when
    /// the key's waiter mark is first confirmed); never resolves if none comes. Subscribes
    /// before returning, so a release that happens before the first poll still counts.
    pub(super) fn subscribe(&self, advisory_key: i64) -> impl Future<Output = ()> + Send + 'static {
        self.start();
        let mut receiver = self.waiters.subscribe(advisory_key);
        async move {
            if receiver.changed().await.is_err() {
                // The listener is gone (the backend was dropped): polling takes over.
                std::future::pending::<()>().await;
            }
        }
    }

    fn start(&self) {
        if self.started.load(Ordering::Acquire) {
            return;
        }
        // Outside a runtime there is nothing to spawn on; a later call inside one starts it.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        runtime.spawn(listen(
            Arc::clone(&self.waiters),
            self.config.clone(),
            self.tls.clone(),
            self.stop.clone(),
        ));
    }
}

impl Drop for ReleaseWatch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Where a key's waiter mark stands in the listener's session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mark {
    /// The key has (or had) a waiter; the listener should take the mark.
    Wanted,
    /// The listener's session holds the mark.
    Held,
    /// The last try found the mark taken exclusively; retried at the next sweep.
    Refused,
}

struct KeyWatch {
    sender: watch::Sender<()>,
    mark: Mark,
}

impl KeyWatch {
    fn waited_for(&self) -> bool {
        self.sender.receiver_count() > 0
    }
}

/// One step of bringing the session's marks in line with the keys waited for.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Mark(i64),
    Unmark(i64),
}

#[derive(Default)]
struct Waiters {
    by_key: Mutex<WaiterMap>,
    /// Signalled when a key needs its mark taken.
    work: Notify,
}

#[derive(Default)]
struct WaiterMap {
    keys: HashMap<i64, KeyWatch>,
    sweep_at: usize,
}

impl Waiters {
    fn lock(&self) -> MutexGuard<'_, WaiterMap> {
        // The map stays consistent whatever panicked while holding it.
        self.by_key
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn subscribe(&self, advisory_key: i64) -> watch::Receiver<()> {
        let mut map = self.lock();
        if map.keys.len() >= map.sweep_at.max(FIRST_SWEEP) {
            // Entries with a mark held stay: the listener must give the mark up first.
            map.keys
                .retain(|_, watch| watch.waited_for() || watch.mark == Mark::Held);
            map.sweep_at = map.keys.len() * 2;
        }
        let watch = map.keys.entry(advisory_key).or_insert_with(|| KeyWatch {
            sender: watch::channel(()).0,
            mark: Mark::Wanted,
        });
        let receiver = watch.sender.subscribe();
        let needs_mark = watch.mark == Mark::Wanted;
        drop(map);
        if needs_mark {
            self.work.notify_one();
        }
        receiver
    }

    /// The next step the listener should take, if any. With `sweeping`, marks nobody needs
    /// any more are given up too.
    fn next_step(&self, sweeping: bool) -> Option<Step> {
        let mut map = self.lock();
        let mut unused = Vec::new();
        let mut step = None;
        for (&key, watch) in &map.keys {
            match (watch.mark, watch.waited_for()) {
                (Mark::Wanted, true) => {
                    step = Some(Step::Mark(key));
                    break;
                }
                (Mark::Held, false) if sweeping => {
                    step = Some(Step::Unmark(key));
                    break;
                }
                (Mark::Wanted | Mark::Refused, false) => unused.push(key),
                _ => {}
            }
        }
        for key in unused {
            map.keys.remove(&key);
        }
        step
    }

    /// Starts a sweep: refused marks are wanted again.
    fn begin_sweep(&self) {
        for watch in self.lock().keys.values_mut() {
            if watch.mark == Mark::Refused {
                watch.mark = Mark::Wanted;
            }
        }
    }

    /// Records the answer to a mark. A confirmed mark wakes the key's waiters once: a release
    /// between their last attempt and the mark sent no notification.
    fn marked(&self, advisory_key: i64, taken: bool) {
        let mut map = self.lock();
        if let Some(watch) = map.keys.get_mut(&advisory_key) {
            if taken {
                watch.mark = Mark::Held;
                watch.sender.send_replace(());
            } else {
                watch.mark = Mark::Refused;
            }
        }
    }

    /// Records a mark given up; a waiter that arrived meanwhile wants it again.
    fn unmarked(&self, advisory_key: i64) {
        let mut map = self.lock();
        if let Some(watch) = map.keys.get_mut(&advisory_key) {
            if watch.waited_for() {
                watch.mark = Mark::Wanted;
            } else {
                map.keys.remove(&advisory_key);
            }
        }
    }

    /// Whether the session holds any mark.
    fn holds_marks(&self) -> bool {
        self.lock()
            .keys
            .values()
            .any(|watch| watch.mark == Mark::Held)
    }

    /// The session ended, and the server dropped its marks with it.
    fn session_ended(&self) {
        let mut map = self.lock();
        map.keys.retain(|_, watch| watch.waited_for());
        for watch in map.keys.values_mut() {
            watch.mark = Mark::Wanted;
        }
    }

    fn wake(&self, advisory_key: i64) {
        if let Some(watch) = self.lock().keys.get(&advisory_key) {
            watch.sender.send_replace(());
        }
    }

    fn wake_all(&self) {
        for watch in self.lock().keys.values() {
            watch.sender.send_replace(());
        }
    }
}

/// Keeps a listening session up until `stop`, reconnecting with backoff.
async fn listen(
    waiters: Arc<Waiters>,
    config: Config,
    tls: MakeRustlsConnect,
    stop: CancellationToken,
) {
    let mut retry = FIRST_RETRY;
    while !stop.is_cancelled() {
        let listened = session(&waiters, &config, &tls, &stop).await;
        waiters.session_ended();
        if listened {
            retry = FIRST_RETRY;
        }
        waiters.wake_all();
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(retry) => {}
        }
        retry = (retry * 2).min(LAST_RETRY);
    }
}

type Reconcile<'a> = Pin<Box<dyn Future<Output = Result<(), ()>> + Send + 'a>>;

/// One listening session, until it ends or `stop`; whether it got as far as listening.
async fn session(
    waiters: &Waiters,
    config: &Config,
    tls: &MakeRustlsConnect,
    stop: &CancellationToken,
) -> bool {
    let connecting = tokio::select! {
        _ = stop.cancelled() => return false,
        connecting = config.connect(tls.clone()) => connecting,
    };
    let Ok((client, mut connection)) = connecting else {
        return false;
    };
    let listen = client.batch_execute(LISTEN);
    tokio::pin!(listen);
    let mut listening = false;
    let mut reconcile: Option<Reconcile<'_>> = None;
    let mut sweep = tokio::time::interval(SWEEP);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let idle = listening && reconcile.is_none();
        tokio::select! {
            _ = stop.cancelled() => return listening,
            subscribed = &mut listen, if !listening => {
                if subscribed.is_err() {
                    return false;
                }
                listening = true;
                // Releases while nobody listened were missed: let every waiter look once.
                waiters.wake_all();
                reconcile = Some(Box::pin(bring_marks_in_line(&client, waiters, false)));
            }
            done = poll_reconcile(&mut reconcile), if reconcile.is_some() => {
                reconcile = None;
                if done.is_err() {
                    return listening;
                }
            }
            _ = waiters.work.notified(), if idle => {
                reconcile = Some(Box::pin(bring_marks_in_line(&client, waiters, false)));
            }
            _ = sweep.tick(), if idle && waiters.holds_marks() => {
                waiters.begin_sweep();
                reconcile = Some(Box::pin(bring_marks_in_line(&client, waiters, true)));
            }
            message = poll_fn(|cx| connection.poll_message(cx)) => match message {
                Some(Ok(AsyncMessage::Notification(notification))) => {
                    if let Ok(advisory_key) = notification.payload().parse::<i64>() {
                        waiters.wake(advisory_key);
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return listening,
            },
        }
    }
}

/// Polls the running reconcile to its end.
async fn poll_reconcile(reconcile: &mut Option<Reconcile<'_>>) -> Result<(), ()> {
    match reconcile.as_mut() {
        Some(running) => running.await,
        None => std::future::pending().await,
    }
}

/// Takes the marks of keys waited for and, when `sweeping`, gives up those of keys nobody
/// waits for. A statement that fails or hangs ends the session.
async fn bring_marks_in_line(client: &Client, waiters: &Waiters, sweeping: bool) -> Result<(), ()> {
    while let Some(step) = waiters.next_step(sweeping) {
        let (key, sql) = match step {
            Step::Mark(key) => (key, MARK),
            Step::Unmark(key) => (key, UNMARK),
        };
        let (high, low) = waiter_mark(key);
        let answer = tokio::time::timeout(STATEMENT_TIMEOUT, client.query_one(sql, &[&high, &low]))
            .await
            .map_err(|_| ())?
            .map_err(|_| ())?;
        let yes: bool = answer.try_get(0).map_err(|_| ())?;
        match step {
            Step::Mark(key) => waiters.marked(key, yes),
            Step::Unmark(key) => waiters.unmarked(key),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_waiter_mark_is_the_keys_high_and_low_halves() {
        assert_eq!(waiter_mark(0x0000_0001_0000_0002), (1, 2));
        assert_eq!(waiter_mark(-1), (-1, -1));
        assert_eq!(waiter_mark(i64::MIN), (i32::MIN, 0));
        assert_eq!(waiter_mark(0x7fff_ffff_8000_0000), (i32::MAX, i32::MIN));
    }

    #[tokio::test]
    async fn a_key_is_marked_while_waited_for_and_unmarked_by_the_sweep_after() {
        let waiters = Waiters::default();
        let hint = waiters.subscribe(7);
        assert_eq!(waiters.next_step(false), Some(Step::Mark(7)));
        let woken = hint.clone();
        waiters.marked(7, true);
        assert!(
            woken.has_changed().unwrap_or(false),
            "a confirmed mark wakes the waiter once"
        );
        assert_eq!(waiters.next_step(false), None, "held marks need nothing");
        assert_eq!(waiters.next_step(true), None, "still waited for");
        drop((hint, woken));
        assert_eq!(
            waiters.next_step(false),
            None,
            "only a sweep gives marks up"
        );
        assert_eq!(waiters.next_step(true), Some(Step::Unmark(7)));
        waiters.unmarked(7);
        assert!(!waiters.holds_marks());
        assert_eq!(waiters.next_step(true), None);
    }

    #[tokio::test]
    async fn a_refused_mark_is_retried_at_the_next_sweep_only() {
        let waiters = Waiters::default();
        let _hint = waiters.subscribe(9);
        assert_eq!(waiters.next_step(false), Some(Step::Mark(9)));
        waiters.marked(9, false);
        assert_eq!(waiters.next_step(false), None);
        assert_eq!(waiters.next_step(true), None);
        waiters.begin_sweep();
        assert_eq!(waiters.next_step(true), Some(Step::Mark(9)));
    }

    #[tokio::test]
    async fn a_waiter_arriving_while_its_mark_is_given_up_wants_it_again() {
        let waiters = Waiters::default();
        drop(waiters.subscribe(5));
        let hint = waiters.subscribe(5);
        waiters.marked(5, true);
        drop(hint);
        assert_eq!(waiters.next_step(true), Some(Step::Unmark(5)));
        let _again = waiters.subscribe(5);
        waiters.unmarked(5);
        assert_eq!(waiters.next_step(false), Some(Step::Mark(5)));
    }

    #[tokio::test]
    async fn an_ended_session_wants_every_mark_still_waited_for_again() {
        let waiters = Waiters::default();
        let _kept = waiters.subscribe(1);
        let left = waiters.subscribe(2);
        waiters.marked(1, true);
        waiters.marked(2, true);
        drop(left);
        waiters.session_ended();
        assert!(!waiters.holds_marks());
        assert_eq!(waiters.next_step(false), Some(Step::Mark(1)));
        waiters.marked(1, true);
        assert_eq!(waiters.next_step(true), None, "key 2 left with the session");
    }
}
