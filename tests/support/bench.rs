//! Engine-level measurements shared by the benchmark program (`tests/benches/lockingkit.rs`):
//! in-memory throughput, backend attempts while many local callers wait, local hand-off on
//! any backend, and cross-process hand-off with and without the backend's release hint.

use lockingkit::LockMode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockingkit::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use lockingkit::{DistributedLock, MemoryBackend, MemoryStore};

/// How a harness-less benchmark binary was invoked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchMode {
    /// `cargo bench`: measure for real.
    Full,
    /// `cargo test --all-targets`: a few samples, to know it still works.
    Smoke,
}

impl BenchMode {
    /// The mode from the process arguments; `None` when a test runner (nextest) only asks
    /// for the binary's test list, of which there is none.
    pub fn from_args() -> Option<BenchMode> {
        let args: Vec<String> = std::env::args().collect();
        if args.iter().any(|a| a == "--list") {
            return None;
        }
        Some(if args.iter().any(|a| a == "--bench") {
            BenchMode::Full
        } else {
            BenchMode::Smoke
        })
    }

    /// `full` when measuring for real, `smoke` otherwise.
    pub fn pick<T>(self, full: T, smoke: T) -> T {
        match self {
            BenchMode::Full => full,
            BenchMode::Smoke => smoke,
        }
    }
}

/// The two-worker multi-thread runtime the backend benchmarks measure on.
pub fn two_worker_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Median and 99th percentile of a set of samples.
#[derive(Clone, Copy, Debug)]
pub struct Percentiles {
    pub p50: Duration,
    pub p99: Duration,
}

impl Percentiles {
    /// The percentiles of `samples` (zero when empty).
    pub fn of(mut samples: Vec<Duration>) -> Percentiles {
        samples.sort_unstable();
        let at = |q: f64| {
            let index = ((samples.len() as f64 - 1.0) * q).round() as usize;
            samples.get(index).copied().unwrap_or_default()
        };
        Percentiles {
            p50: at(0.5),
            p99: at(0.99),
        }
    }
}

/// Runs `measure` on a current-thread runtime with the raw in-memory backend and a lock on an
/// in-memory store of its own, the setting of the single-thread in-memory measurements.
fn on_one_thread<T>(measure: impl AsyncFnOnce(&MemoryBackend, &DistributedLock) -> T) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let raw = MemoryBackend::new(MemoryStore::new());
        let locks = DistributedLock::in_memory_shared(&MemoryStore::new());
        measure(&raw, &locks).await
    })
}

/// Uncontended `try_acquire` + `release` pairs per second on one thread: (lockingkit, the raw
/// in-memory backend doing the same two calls), each the best of five interleaved rounds.
pub fn in_memory_pairs_per_second(pairs: u32) -> (f64, f64) {
    on_one_thread(async |raw, locks| {
        // Warm up both paths (allocator, hash map capacity).
        for _ in 0..pairs.min(10_000) {
            let acquired = raw
                .try_acquire("bench", LockMode::Exclusive)
                .await
                .unwrap()
                .unwrap();
            raw.release(&acquired.lease).await.unwrap();
            let handle = locks.try_acquire("bench").await.unwrap();
            handle.release().await.unwrap();
        }
        let mut best_raw = 0f64;
        let mut best_engine = 0f64;
        // Interleave rounds so both sides see the same machine noise; keep each side's best.
        for _ in 0..5 {
            let start = Instant::now();
            for _ in 0..pairs {
                let acquired = raw
                    .try_acquire("bench", LockMode::Exclusive)
                    .await
                    .unwrap()
                    .unwrap();
                raw.release(&acquired.lease).await.unwrap();
            }
            best_raw = best_raw.max(f64::from(pairs) / start.elapsed().as_secs_f64());

            let start = Instant::now();
            for i in 0..pairs {
                let handle = locks.try_acquire("bench").await.unwrap();
                handle.release().await.unwrap();
                if i % 64 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            best_engine = best_engine.max(f64::from(pairs) / start.elapsed().as_secs_f64());
        }
        (best_engine, best_raw)
    })
}

/// One in-memory `try_acquire` + `release` through the engine and through the raw backend,
/// with the CPU caches evicted before each call: medians of (lockingkit, raw backend) over
/// `pairs` interleaved pairs.
///
/// Against a real backend the engine's code and data are cold on every call: while the
/// request is on the wire the server process (on the same cores here) and other tenants of
/// the host evict them. This shows what the engine costs then, which in-memory throughput on
/// warm caches hides. Writing a buffer larger than the last-level cache stands in for that.
pub fn cold_cache_pairs(pairs: u32) -> (Duration, Duration) {
    const EVICTION_BYTES: usize = 64 << 20;
    on_one_thread(async |raw, locks| {
        let mut evictor = vec![0u8; EVICTION_BYTES];
        let mut evict = |round: u32| {
            // One write per cache line, each round a different value so none is elided.
            for byte in evictor.iter_mut().step_by(64) {
                *byte = byte.wrapping_add(round as u8 | 1);
            }
            std::hint::black_box(&evictor);
        };
        let (mut engine, mut bare) = (Vec::new(), Vec::new());
        for round in 0..pairs {
            evict(round);
            let started = Instant::now();
            let handle = locks.try_acquire("bench/cold").await.unwrap();
            let acquiring = started.elapsed();
            evict(round);
            let started = Instant::now();
            handle.release().await.unwrap();
            engine.push(acquiring + started.elapsed());

            evict(round);
            let started = Instant::now();
            let acquired = raw
                .try_acquire("bench/cold", LockMode::Exclusive)
                .await
                .unwrap()
                .unwrap();
            let acquiring = started.elapsed();
            evict(round);
            let started = Instant::now();
            raw.release(&acquired.lease).await.unwrap();
            bare.push(acquiring + started.elapsed());
        }
        (Percentiles::of(engine).p50, Percentiles::of(bare).p50)
    })
}

/// Counts attempts that reach the in-memory backend, and how many were in flight at once.
struct Counting {
    inner: MemoryBackend,
    attempts: Arc<AtomicU64>,
    in_flight: Arc<AtomicU64>,
    most_in_flight: Arc<AtomicU64>,
}

impl LockBackend for Counting {
    type Lease = <MemoryBackend as LockBackend>::Lease;
    fn provider(&self) -> &str {
        "counting"
    }
    fn timing(&self) -> LeaseTiming {
        self.inner.timing()
    }
    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<Self::Lease>>, BackendError> {
        self.attempts.fetch_add(1, Ordering::Relaxed);
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.most_in_flight.fetch_max(now, Ordering::Relaxed);
        // A scheduling point inside the attempt: streams the engine failed to merge would
        // overlap here.
        tokio::task::yield_now().await;
        let result = self.inner.try_acquire(key, mode).await;
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        result
    }
    async fn renew(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.inner.renew(lease).await
    }
    async fn release(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.inner.release(lease).await
    }
}

/// What reached the backend while local callers waited.
#[derive(Clone, Copy, Debug)]
pub struct WaitingAttempts {
    /// Attempts in all.
    pub attempts: u64,
    /// The most attempts in flight at one moment: 1 means a single stream.
    pub most_at_once: u64,
}

/// Backend attempts while `waiters` local callers wait 60 s (virtual time) for a key held
/// by another process.
pub fn attempts_while_waiting(waiters: usize) -> WaitingAttempts {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let store = MemoryStore::new();
        let attempts = Arc::new(AtomicU64::new(0));
        let most_in_flight = Arc::new(AtomicU64::new(0));
        let locks = DistributedLock::builder(Counting {
            inner: MemoryBackend::new(store.clone()),
            attempts: attempts.clone(),
            in_flight: Arc::new(AtomicU64::new(0)),
            most_in_flight: most_in_flight.clone(),
        })
        .build()
        .unwrap();
        let remote = DistributedLock::in_memory_shared(&store);
        let held = remote.try_acquire("job").await.unwrap();
        let tasks: Vec<_> = (0..waiters)
            .map(|_| {
                let locks = locks.clone();
                tokio::spawn(async move { locks.acquire("job", Duration::from_secs(60)).await })
            })
            .collect();
        for task in tasks {
            let _ = task.await;
        }
        drop(held);
        WaitingAttempts {
            attempts: attempts.load(Ordering::Relaxed),
            most_at_once: most_in_flight.load(Ordering::Relaxed),
        }
    })
}

/// Local hand-off: from the start of a holder's `release` to the moment the next caller of
/// the same `DistributedLock`, already waiting, holds the key. Call from a multi-thread
/// runtime.
pub async fn local_handoff(locks: &DistributedLock, key: &str, samples: usize) -> Percentiles {
    handoff(locks, locks, key, samples, |_| Duration::ZERO).await
}

/// Cross-process hand-off: `holder` and `waiter` are two `DistributedLock`s with backends of
/// their own (two pools, two sets of watchers), as two processes have. The hold lasts from
/// 20 ms to about 1 s, so that releases land at every point of the waiter's backoff (50 ms
/// doubling to 1 s by default).
pub async fn cross_process_handoff(
    holder: &DistributedLock,
    waiter: &DistributedLock,
    key: &str,
    samples: usize,
) -> Percentiles {
    handoff(holder, waiter, key, samples, |i| {
        Duration::from_millis(20 + (i as u64 * 389) % 1000)
    })
    .await
}

/// Each sample: `holder` takes the key, `waiter` starts waiting, the hold lasts `hold(i)`, then
/// from the start of the release to the moment `waiter` holds the key.
async fn handoff(
    holder: &DistributedLock,
    waiter: &DistributedLock,
    key: &str,
    samples: usize,
    hold: impl Fn(usize) -> Duration,
) -> Percentiles {
    let mut taken = Vec::with_capacity(samples);
    for i in 0..samples {
        let held = holder.try_acquire(key).await.unwrap();
        let waiting = tokio::spawn({
            let waiter = waiter.clone();
            let key = key.to_owned();
            async move {
                let handle = waiter.acquire(&key, Duration::from_secs(10)).await.unwrap();
                let at = Instant::now();
                handle.release().await.unwrap();
                at
            }
        });
        while waiter.waiting(key) == 0 {
            tokio::task::yield_now().await;
        }
        let hold = hold(i);
        if !hold.is_zero() {
            tokio::time::sleep(hold).await;
        }
        let released = Instant::now();
        held.release().await.unwrap();
        let acquired = waiting.await.unwrap();
        taken.push(acquired.saturating_duration_since(released));
    }
    Percentiles::of(taken)
}

/// A backend with its release hint hidden: waiting is pure polling, the baseline the hint
/// is measured against.
pub struct PollingOnly<B>(pub B);

impl<B: LockBackend> LockBackend for PollingOnly<B> {
    type Lease = B::Lease;
    fn provider(&self) -> &str {
        self.0.provider()
    }
    fn timing(&self) -> LeaseTiming {
        self.0.timing()
    }
    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<Self::Lease>>, BackendError> {
        self.0.try_acquire(key, mode).await
    }
    async fn renew(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.0.renew(lease).await
    }
    async fn release(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.0.release(lease).await
    }
    fn lease_ended(&self, lease: &Self::Lease) -> impl std::future::Future<Output = ()> + Send {
        self.0.lease_ended(lease)
    }
}
