//! How the engine behaves around a backend that is down, hung or refusing us, on paused tokio
//! time: an outage is never answered as contention, callers that meet an attempt in flight wait
//! for its answer instead of sending their own or guessing, a failing backend is asked one
//! attempt at a time with a growing backoff, and the log gets one line per state change.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockingkit::backend::BackendError;
use lockingkit::testing::{Call, Intercept};
use lockingkit::{DistributedLock, ErrorKind, LockError, LockHandle, MemoryBackend, MemoryStore};
use tokio::time::Instant;

/// How the [`Flaky`] backend fails while it is down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Nothing listens: every attempt fails as unreachable after its latency.
    Unreachable,
    /// The server answers, refusing our credentials.
    BadPassword,
    /// The server takes every attempt and never answers it until the client's own statement
    /// timeout ([`HUNG_FOR`]) gives up, as a frozen server does.
    Hung,
}

/// How long a hung attempt waits for its statement timeout.
const HUNG_FOR: Duration = Duration::from_secs(5);

/// An in-memory backend behind a network of `latency` ([`Flaky::backend`]), which can go down
/// in the ways of [`Fault`]; it counts the attempts that reach it.
#[derive(Clone)]
struct Flaky {
    inner: MemoryBackend,
    latency: Duration,
    down: Arc<Mutex<Option<Fault>>>,
    attempts: Arc<AtomicUsize>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
}

impl Flaky {
    fn new(store: &MemoryStore, latency: Duration) -> Self {
        Flaky {
            inner: MemoryBackend::new(store.clone()),
            latency,
            down: Arc::default(),
            attempts: Arc::default(),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
        }
    }

    fn go_down(&self, fault: Fault) {
        *self.down.lock().unwrap() = Some(fault);
    }

    fn come_back(&self) {
        *self.down.lock().unwrap() = None;
    }

    fn attempts(&self) -> usize {
        self.attempts.load(Ordering::SeqCst)
    }

    /// The backend whose attempts go through [`Flaky::attempt`].
    fn backend(&self) -> Intercept<MemoryBackend> {
        let flaky = self.clone();
        Intercept::new(self.inner.clone()).on_try_acquire(move |attempt| {
            let flaky = flaky.clone();
            Box::pin(async move { flaky.attempt(attempt).await })
        })
    }

    async fn attempt<T>(&self, attempt: Call<'_, Option<T>>) -> Result<Option<T>, BackendError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let fault = *self.down.lock().unwrap();
        let result = match fault {
            None => {
                tokio::time::sleep(self.latency).await;
                attempt.await
            }
            Some(Fault::Unreachable) => {
                tokio::time::sleep(self.latency).await;
                Err(BackendError::unreachable("connection refused"))
            }
            Some(Fault::BadPassword) => {
                tokio::time::sleep(self.latency).await;
                Err(BackendError::misconfigured(
                    "the server refused the credentials",
                ))
            }
            Some(Fault::Hung) => {
                tokio::time::sleep(HUNG_FOR).await;
                Err(BackendError::unreachable("no answer within 5s"))
            }
        };
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

fn kind(result: Result<LockHandle, LockError>) -> ErrorKind {
    match result {
        Ok(_) => panic!("expected a refusal, got the lock"),
        Err(error) => error.kind(),
    }
}

/// Counts the warnings and notes LockingKit logs (target `lockingkit`), for tests that bound
/// how often an outage is logged.
#[derive(Clone, Default)]
struct LogCount {
    warnings: Arc<AtomicUsize>,
    notes: Arc<AtomicUsize>,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for LogCount {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let meta = event.metadata();
        if meta.target() != "lockingkit" {
            return;
        }
        match *meta.level() {
            tracing::Level::WARN | tracing::Level::ERROR => {
                self.warnings.fetch_add(1, Ordering::SeqCst);
            }
            tracing::Level::INFO => {
                self.notes.fetch_add(1, Ordering::SeqCst);
            }
            _ => {}
        }
    }
}

impl LogCount {
    /// Installs the counter for this thread (the paused-time runtime runs on it).
    fn install(&self) -> tracing::subscriber::DefaultGuard {
        use tracing_subscriber::layer::SubscriberExt;
        tracing::subscriber::set_default(tracing_subscriber::registry().with(self.clone()))
    }

    fn counts(&self) -> (usize, usize) {
        (
            self.warnings.load(Ordering::SeqCst),
            self.notes.load(Ordering::SeqCst),
        )
    }
}

#[tokio::test(start_paused = true)]
async fn callers_that_meet_an_attempt_in_flight_wait_for_its_answer_and_are_told_it() {
    let store = MemoryStore::new();
    let flaky = Flaky::new(&store, Duration::from_millis(100));
    let locks = DistributedLock::builder(flaky.backend()).build().unwrap();
    flaky.go_down(Fault::Unreachable);

    let first = tokio::spawn({
        let locks = locks.clone();
        async move { kind(locks.try_acquire("k").await) }
    });
    while flaky.attempts() == 0 {
        tokio::task::yield_now().await;
    }
    // Two more callers arrive while the first attempt is in flight: they send nothing of their
    // own, and they are not told "busy" either, since nobody holds the key.
    let met: Vec<_> = (0..2)
        .map(|_| {
            let locks = locks.clone();
            tokio::spawn(async move { kind(locks.try_acquire("k").await) })
        })
        .collect();
    assert_eq!(first.await.unwrap(), ErrorKind::Unavailable);
    for caller in met {
        assert_eq!(caller.await.unwrap(), ErrorKind::Unavailable);
    }
    assert_eq!(
        flaky.attempts(),
        1,
        "one attempt answered all three callers"
    );

    // Back up, with the key held by another process. A caller that meets the next attempt in
    // flight, the gate's probe, is refused at once with the outage's cause (nothing says yet
    // that the backend is back); once the probe is answered, callers are told what it found.
    flaky.come_back();
    let elsewhere = DistributedLock::in_memory_shared(&store);
    let _held = elsewhere.try_acquire("k").await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await; // past the first probe's backoff
    let attempts = flaky.attempts();
    let probe = tokio::spawn({
        let locks = locks.clone();
        async move { kind(locks.try_acquire("k").await) }
    });
    while flaky.attempts() == attempts {
        tokio::task::yield_now().await;
    }
    let met = kind(locks.try_acquire("k").await);
    assert_eq!(
        (probe.await.unwrap(), met),
        (ErrorKind::Busy, ErrorKind::Unavailable)
    );
    assert_eq!(flaky.attempts(), attempts + 1);
    assert_eq!(kind(locks.try_acquire("k").await), ErrorKind::Busy);
    assert_eq!(flaky.attempts(), attempts + 2);
}

#[tokio::test(start_paused = true)]
async fn an_attempt_that_hangs_is_an_outage_to_the_callers_that_meet_it() {
    let store = MemoryStore::new();
    let flaky = Flaky::new(&store, Duration::from_millis(1));
    let locks = DistributedLock::builder(flaky.backend()).build().unwrap();
    flaky.go_down(Fault::Hung);
    let start = Instant::now();
    let first = tokio::spawn({
        let locks = locks.clone();
        async move { kind(locks.try_acquire("k").await) }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // An attempt unanswered for the engine's patience (the longest retry delay, and at least
    // 2 s: a backend that answers takes far less) is an outage: its caller is told so, and so at the same
    // moment is the caller that met it, while the attempt itself runs on to its own timeout.
    let met = locks.try_acquire("k").await.unwrap_err();
    assert_eq!(met.kind(), ErrorKind::Unavailable, "{met}");
    assert!(met.to_string().contains("did not answer"), "{met}");
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(first.await.unwrap(), ErrorKind::Unavailable);
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    // Later callers are refused at once, with nothing sent, until the gate's probe is due.
    let refused = locks.try_acquire("k").await.unwrap_err();
    assert!(refused.to_string().contains("did not answer"), "{refused}");
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    tokio::time::sleep(HUNG_FOR).await;
    assert_eq!(flaky.attempts(), 1);
}

/// Sixty-four clients, each calling `try_acquire` on one of eight keys every 10 ms for
/// `length`, as the routes of a busy service do. Returns how often each kind of refusal came
/// back, and how many locks were taken.
async fn clients_for(locks: &DistributedLock, length: Duration) -> (Vec<ErrorKind>, usize) {
    let until = Instant::now() + length;
    let clients: Vec<_> = (0..64)
        .map(|client| {
            let locks = locks.clone();
            tokio::spawn(async move {
                let key = format!("accounts/{}", client % 8);
                let (mut refusals, mut taken) = (Vec::new(), 0);
                while Instant::now() < until {
                    match locks.try_acquire(&key).await {
                        Ok(handle) => {
                            taken += 1;
                            let _ = handle.release().await;
                        }
                        Err(error) => refusals.push(error.kind()),
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                (refusals, taken)
            })
        })
        .collect();
    let mut all = (Vec::new(), 0);
    for client in clients {
        let (refusals, taken) = client.await.unwrap();
        all.0.extend(refusals);
        all.1 += taken;
    }
    all
}

#[tokio::test(start_paused = true)]
async fn under_an_outage_no_caller_is_told_busy_and_the_backend_is_asked_once_at_a_time() {
    let log = LogCount::default();
    let _log = log.install();
    let store = MemoryStore::new();
    let flaky = Flaky::new(&store, Duration::from_millis(2));
    let locks = DistributedLock::builder(flaky.backend()).build().unwrap();

    flaky.go_down(Fault::Unreachable);
    let (refusals, taken) = clients_for(&locks, Duration::from_secs(5)).await;
    assert_eq!(taken, 0);
    assert!(refusals.len() > 10_000, "{} calls", refusals.len());
    assert!(
        refusals.iter().all(|kind| *kind == ErrorKind::Unavailable),
        "an outage is never contention: {:?}",
        refusals
            .iter()
            .find(|kind| **kind != ErrorKind::Unavailable)
    );
    // The eight keys' first attempts went out together; after that one probe at a time, 50 ms
    // after the failure, then each twice as long after the last (jittered down to half), up to
    // 1 s and then exactly 1 s apart: 25 + 50 + 100 + 200 + 400 ms at the shortest, then four
    // more seconds, so nine probes in 5 s at most, whatever the jitter drew.
    let during = flaky.attempts();
    assert!(
        during <= 8 + 9,
        "{during} attempts reached the failing backend in 5 s"
    );
    assert_eq!(log.counts(), (1, 0), "one warning for the whole outage");

    flaky.come_back();
    // Service resumes at the next probe, at most 1 s away.
    let back = Instant::now();
    loop {
        match locks.try_acquire("accounts/0").await {
            Ok(handle) => break handle.release().await.unwrap(),
            Err(error) => assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}"),
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        back.elapsed() <= Duration::from_secs(1),
        "{:?}",
        back.elapsed()
    );
    let (refusals, taken) = clients_for(&locks, Duration::from_secs(6)).await;
    assert!(
        taken > 1000,
        "service resumes after the next probe: {taken} locks taken"
    );
    assert!(
        refusals
            .iter()
            .all(|kind| *kind != ErrorKind::Misconfigured),
        "{refusals:?}"
    );
    assert_eq!(
        log.counts(),
        (1, 1),
        "one note when the backend answers again"
    );
}

#[tokio::test(start_paused = true)]
async fn refused_credentials_are_misconfigured_for_every_caller_and_the_server_is_spared() {
    let store = MemoryStore::new();
    let flaky = Flaky::new(&store, Duration::from_millis(2));
    let locks = DistributedLock::builder(flaky.backend()).build().unwrap();
    flaky.go_down(Fault::BadPassword);
    let (refusals, _) = clients_for(&locks, Duration::from_secs(5)).await;
    assert!(refusals
        .iter()
        .all(|kind| *kind == ErrorKind::Misconfigured));
    // One login per probe, as above: at most nine in 5 s after the first eight.
    assert!(flaky.attempts() <= 8 + 9, "{} logins", flaky.attempts());
    // A waiter stops at once: no retry fixes a password, whether its attempt was sent or not.
    let start = Instant::now();
    let waited = locks.acquire("k", Duration::from_secs(30)).await;
    assert_eq!(kind(waited), ErrorKind::Misconfigured);
    assert_eq!(start.elapsed(), Duration::ZERO, "refused without a request");
}

#[tokio::test(start_paused = true)]
async fn a_refusal_says_why_and_when_the_backend_is_asked_again() {
    let store = MemoryStore::new();
    let flaky = Flaky::new(&store, Duration::from_millis(2));
    let locks = DistributedLock::builder(flaky.backend()).build().unwrap();
    flaky.go_down(Fault::Unreachable);
    assert_eq!(kind(locks.try_acquire("a").await), ErrorKind::Unavailable);
    let refused = locks.try_acquire("b").await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::Unavailable);
    let text = refused.to_string();
    assert!(text.contains("connection refused"), "the cause: {text}");
    assert!(text.contains("not sent"), "{text}");
    assert!(std::error::Error::source(&refused).is_none() || text.contains("refused"));
    assert_eq!(
        flaky.attempts(),
        1,
        "the second key was refused without a request"
    );
}

#[tokio::test(start_paused = true)]
async fn waiters_during_an_outage_end_unavailable_with_the_cause_and_send_one_probe_at_a_time() {
    let store = MemoryStore::new();
    let flaky = Flaky::new(&store, Duration::from_millis(2));
    let locks = DistributedLock::builder(flaky.backend()).build().unwrap();
    flaky.go_down(Fault::Unreachable);
    let waiters: Vec<_> = (0..20)
        .map(|i| {
            let locks = locks.clone();
            tokio::spawn(async move {
                locks
                    .acquire(&format!("k{i}"), Duration::from_secs(5))
                    .await
            })
        })
        .collect();
    for waiter in waiters {
        let error = waiter.await.unwrap().unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
        assert!(error.to_string().contains("connection refused"), "{error}");
    }
    assert!(
        flaky.attempts() <= 20 + 7,
        "{} attempts by 20 waiters in 5 s",
        flaky.attempts()
    );
    assert!(flaky.max_in_flight.load(Ordering::SeqCst) <= 20);
}

#[tokio::test(start_paused = true)]
async fn a_backend_that_answers_again_is_used_again_within_the_longest_outage_delay() {
    let store = MemoryStore::new();
    let flaky = Flaky::new(&store, Duration::from_millis(2));
    let locks = DistributedLock::builder(flaky.backend())
        .options(
            lockingkit::LockOptions::default().with_max_outage_retry_delay(Duration::from_secs(2)),
        )
        .build()
        .unwrap();
    flaky.go_down(Fault::Unreachable);
    // Thirty seconds of failures: the probes' backoff reaches its 2 s cap.
    let outage_ends = Instant::now() + Duration::from_secs(30);
    while Instant::now() < outage_ends {
        assert_eq!(kind(locks.try_acquire("k").await), ErrorKind::Unavailable);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    flaky.come_back();
    let back = Instant::now();
    let recovered = Arc::new(AtomicBool::new(false));
    while !recovered.load(Ordering::SeqCst) {
        if locks.try_acquire("k").await.is_ok() {
            recovered.store(true, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        back.elapsed() <= Duration::from_secs(2) + Duration::from_millis(20),
        "the capped backoff asks again within 2 s: {:?}",
        back.elapsed()
    );
}
