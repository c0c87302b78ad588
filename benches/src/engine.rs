//! The engine alone, with no server: in-memory pairs per second and one pair on cold caches
//! (row 3), and the backend attempts while many local callers wait (row 4).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockingkit::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use lockingkit::{DistributedLock, LockMode, MemoryBackend, MemoryStore};

use crate::pair::{backend_pair, lock_on, lock_pair};
use crate::samples::Percentiles;

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
            backend_pair(raw, "bench").await;
            lock_pair(locks, "bench").await;
        }
        let mut best_raw = 0f64;
        let mut best_engine = 0f64;
        // Interleave rounds so both sides see the same machine noise; keep each side's best.
        for _ in 0..5 {
            let start = Instant::now();
            for _ in 0..pairs {
                backend_pair(raw, "bench").await;
            }
            best_raw = best_raw.max(f64::from(pairs) / start.elapsed().as_secs_f64());

            let start = Instant::now();
            for i in 0..pairs {
                lock_pair(locks, "bench").await;
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
        let locks = lock_on(Counting {
            inner: MemoryBackend::new(store.clone()),
            attempts: attempts.clone(),
            in_flight: Arc::new(AtomicU64::new(0)),
            most_in_flight: most_in_flight.clone(),
        });
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
