//! An attempt whose caller went away: what it finds is no evidence for callers that come later.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockingkit::testing::Intercept;
use lockingkit::{DistributedLock, ErrorKind, LockOptions, MemoryBackend, MemoryStore};
use tokio::sync::{watch, Notify};

/// A point where calls wait until the test opens it; `reached` is told each time one waits.
#[derive(Clone)]
struct Gate {
    reached: Arc<Notify>,
    open: watch::Receiver<bool>,
}

impl Gate {
    fn new(reached: Arc<Notify>, open: watch::Receiver<bool>) -> Self {
        Self { reached, open }
    }

    /// Returns at once while the gate is open; otherwise tells `reached` and waits for it.
    async fn pass(mut self) {
        if !*self.open.borrow() {
            self.reached.notify_one();
            let _ = self.open.wait_for(|open| *open).await;
        }
    }
}

/// `backend` behind a lock that retries every few milliseconds.
fn quickly_retrying(backend: Intercept<MemoryBackend>) -> DistributedLock {
    DistributedLock::builder(backend)
        .options(
            LockOptions::default()
                .with_min_retry_delay(Duration::from_millis(5))
                .with_max_retry_delay(Duration::from_millis(20)),
        )
        .build()
        .expect("valid options")
}

/// A process on `store` whose attempts after the first read the store at once but answer only
/// once `gate` opens.
fn held_back_answers(store: &MemoryStore, gate: Gate) -> DistributedLock {
    let attempts = Arc::new(AtomicUsize::new(0));
    let backend = Intercept::new(MemoryBackend::new(store.clone())).on_try_acquire(move |call| {
        let (attempts, gate) = (attempts.clone(), gate.clone());
        Box::pin(async move {
            let answer = call.await;
            if attempts.fetch_add(1, Ordering::SeqCst) > 0 {
                gate.pass().await;
            }
            answer
        })
    });
    quickly_retrying(backend)
}

/// A waiter's attempt reads "busy" and its caller goes away before the answer arrives; the
/// holder (another process) then releases, confirmed. A try in the waiter's process right
/// after must not be told "busy" by that read from before the release: it waits for the turn
/// and asks the backend itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_try_after_a_confirmed_release_is_not_told_busy_by_an_abandoned_read() {
    let store = MemoryStore::new();
    let reached = Arc::new(Notify::new());
    let (open, gate) = watch::channel(false);
    let waiters = held_back_answers(&store, Gate::new(reached.clone(), gate));
    let holder = DistributedLock::in_memory_shared(&store);

    let held = holder.try_acquire("jobs").await.expect("the holder");
    let waiter = tokio::spawn({
        let waiters = waiters.clone();
        async move { waiters.acquire("jobs", Duration::from_secs(30)).await }
    });
    // The waiter's second attempt has read "busy" and waits to be answered.
    reached.notified().await;
    waiter.abort();
    let _ = waiter.await;
    held.release().await.expect("the holder's release");

    let tried = tokio::spawn({
        let waiters = waiters.clone();
        async move { waiters.try_acquire("jobs").await }
    });
    // Whatever the try does before the held-back answer arrives, it must not end with it.
    tokio::task::yield_now().await;
    open.send_replace(true);
    let handle = tokio::time::timeout(Duration::from_secs(10), tried)
        .await
        .expect("the try ends once the abandoned attempt is answered")
        .expect("the try's task")
        .unwrap_or_else(|error| {
            assert_ne!(
                error.kind(),
                ErrorKind::Busy,
                "told busy by a read from before"
            );
            panic!("the try failed: {error}")
        });
    handle.release().await.expect("release");
}

/// A process on `store` whose attempts after the first wait for `send` before they reach the
/// store, and whose releases wait for `release`.
fn held_back_sends(store: &MemoryStore, send: Gate, release: Gate) -> DistributedLock {
    let attempts = Arc::new(AtomicUsize::new(0));
    let backend = Intercept::new(MemoryBackend::new(store.clone()))
        .on_try_acquire(move |call| {
            let (attempts, send) = (attempts.clone(), send.clone());
            Box::pin(async move {
                if attempts.fetch_add(1, Ordering::SeqCst) > 0 {
                    send.pass().await;
                }
                call.await
            })
        })
        .on_release(move |call| {
            let release = release.clone();
            Box::pin(async move {
                release.pass().await;
                call.await
            })
        });
    quickly_retrying(backend)
}

/// A reader's attempt is on its way when its caller goes away, and reaches the backend only
/// after the holder (another process) released: it takes the key for nobody, and the engine
/// gives it back. A writer's try in that process meanwhile (another lane of the same key) must
/// not be told "busy" by that read lock of nobody's: it waits until the abandoned attempt and
/// its release are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_try_is_not_told_busy_by_a_read_lock_won_for_nobody() {
    let store = MemoryStore::new();
    let (reached, releasing) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (send, send_gate) = watch::channel(false);
    let (release, release_gate) = watch::channel(false);
    let waiters = held_back_sends(
        &store,
        Gate::new(reached.clone(), send_gate),
        Gate::new(releasing.clone(), release_gate),
    );
    let holder = DistributedLock::in_memory_shared(&store);

    let held = holder.try_acquire("jobs").await.expect("the holder");
    let reader = waiters.reader_writer("jobs").expect("a valid key");
    let reading = tokio::spawn(async move { reader.read(Duration::from_secs(30)).await });
    // The reader's second attempt waits to be sent; its caller goes away.
    reached.notified().await;
    reading.abort();
    let _ = reading.await;
    held.release().await.expect("the holder's release");
    // The abandoned attempt takes the key as a reader; giving it back is held back.
    send.send_replace(true);
    releasing.notified().await;

    let mut tried = tokio::spawn({
        let waiters = waiters.clone();
        async move { waiters.try_acquire("jobs").await }
    });
    // Whatever the try is told before the read lock of nobody's is given back, it is not busy.
    if let Ok(early) = tokio::time::timeout(Duration::from_millis(200), &mut tried).await {
        let early = early.expect("the try's task");
        assert!(
            early.is_ok(),
            "told {:?} by a read lock won for nobody",
            early.err().map(|error| error.kind())
        );
    }
    release.send_replace(true);
    let handle = tokio::time::timeout(Duration::from_secs(10), tried)
        .await
        .expect("the try ends once the abandoned read lock is given back")
        .expect("the try's task")
        .expect("the key is free once the read lock of nobody's is given back");
    handle.release().await.expect("release");
}
