//! Release notifications: waking another process's waiter the moment a lock is released.
//!
//! Without them, a waiter in another process learns of a release only at its next attempt,
//! up to the maximum retry delay later. Each release therefore also sends
//! `pg_notify('lockingkit', <advisory key>)` in the same statement as the unlock, and each
//! backend keeps one session of its own that `LISTEN`s on that channel and wakes the waiters
//! of the key (see [`LockBackend::release_hint`](crate::LockBackend::release_hint)).
//!
//! The listener is a hint, never a guarantee, so polling stays the fallback and the cap:
//! - it starts on the first wait, not with the backend, so a backend that never waits never
//!   opens the extra session; it never uses a lock connection of the pool;
//! - while it is down (not yet connected, or reconnecting with backoff) nobody is woken;
//!   when it comes back every waiter is woken once, since releases may have been missed;
//! - a lock freed because its holder's session ended (a crash, `pg_terminate_backend`, a
//!   network loss) sends no notification: NOTIFY runs only in a live session, so such
//!   hand-offs wait for the next attempt;
//! - the payload is the advisory key (a hash, as `pg_locks` shows it), never the lock key.

use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio_postgres::{AsyncMessage, Config};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

/// Every LockingKit backend on a database shares the channel `lockingkit`.
const LISTEN: &str = "LISTEN lockingkit";

/// Reconnection backoff of the listener: a dead server is retried without hammering it.
const FIRST_RETRY: Duration = Duration::from_millis(100);
const LAST_RETRY: Duration = Duration::from_secs(5);

/// Keys without waiters are swept out once the map grows past this (and then past twice the
/// survivors), so memory follows the keys waited on now rather than all keys ever waited on.
const FIRST_SWEEP: usize = 64;

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

    /// Resolves at the next release notification for `advisory_key` after this call; never
    /// resolves if none comes. Subscribes before returning, so a release that happens before
    /// the first poll still counts.
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

#[derive(Default)]
struct Waiters {
    by_key: Mutex<WaiterMap>,
}

#[derive(Default)]
struct WaiterMap {
    senders: HashMap<i64, watch::Sender<()>>,
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
        if map.senders.len() >= map.sweep_at.max(FIRST_SWEEP) {
            map.senders.retain(|_, sender| sender.receiver_count() > 0);
            map.sweep_at = map.senders.len() * 2;
        }
        map.senders
            .entry(advisory_key)
            .or_insert_with(|| watch::channel(()).0)
            .subscribe()
    }

    fn wake(&self, advisory_key: i64) {
        let mut map = self.lock();
        if let Some(sender) = map.senders.get(&advisory_key) {
            if sender.receiver_count() == 0 {
                map.senders.remove(&advisory_key);
            } else {
                sender.send_replace(());
            }
        }
    }

    fn wake_all(&self) {
        for sender in self.lock().senders.values() {
            sender.send_replace(());
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
        if session(&waiters, &config, &tls, &stop).await {
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
    loop {
        tokio::select! {
            _ = stop.cancelled() => return listening,
            subscribed = &mut listen, if !listening => {
                if subscribed.is_err() {
                    return false;
                }
                listening = true;
                // Releases while nobody listened were missed: let every waiter look once.
                waiters.wake_all();
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
