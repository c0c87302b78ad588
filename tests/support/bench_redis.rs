//! What LockingKit adds to a Redis lock's round trips, measured next to the very same Lua scripts
//! sent raw, interleaved in one run against one throwaway server (`tests/benches/lockingkit.rs`
//! prints the rows).
//!
//! - **pair**: `try_acquire` + `release` through `DistributedLock` (the engine, its waiting room,
//!   the keeper scheduled, telemetry) on the backend's one multiplexed connection, next to
//!   `EVALSHA` of the same acquire and release scripts (`lockingkit::providers::redis::lua`) with
//!   the same keys and arguments on one plain multiplexed connection, and next to the backend
//!   alone (`LockBackend` without the engine);
//! - **throughput**: 256 tasks on keys of their own, pairs per second through one
//!   `DistributedLock` (one connection) next to the raw scripts on a pool of 16 connections,
//!   each checked out for a whole pair as deadpool or bb8 would.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lockingkit::backend::LockBackend;
use lockingkit::keys::RedisLockKeys;
use lockingkit::providers::redis::lua;
use lockingkit::{DistributedLock, LockMode, RedisBackend, RedisOptions};
use redis::aio::MultiplexedConnection;
use tokio::sync::Mutex;

use crate::bench::{Percentiles, PollingOnly};
use crate::bench_postgres::Shuffle;
use crate::bench_sessions::{pairs_for, Throughput};
use crate::redis::RedisServer;

/// The lease of every variant: 30 s, the default.
const LEASE_MS: &str = "30000";
/// The writer's intent, as the provider sends it by default.
const INTENT_MS: &str = "2000";

/// The provider on `server` with default options.
pub fn backend(server: &RedisServer) -> RedisBackend {
    RedisBackend::new(RedisOptions::new(server.url())).expect("options")
}

/// A `DistributedLock` on `server` with default options.
pub fn lock(server: &RedisServer) -> DistributedLock {
    DistributedLock::builder(backend(server))
        .build()
        .expect("lock")
}

/// The same, with the provider's wait hidden: waiters in other processes only poll.
pub fn polling_lock(server: &RedisServer) -> DistributedLock {
    DistributedLock::builder(PollingOnly(backend(server)))
        .build()
        .expect("lock")
}

/// The latencies of one run.
#[derive(Clone, Copy, Debug)]
pub struct RedisPairs {
    pub pairs: usize,
    pub lockingkit: Percentiles,
    pub raw: Percentiles,
    pub backend_only: Percentiles,
}

impl RedisPairs {
    /// LockingKit's median over the raw scripts' (the goal is at most 1.10).
    pub fn ratio(&self) -> f64 {
        self.lockingkit.p50.as_secs_f64() / self.raw.p50.as_secs_f64()
    }
}

/// The acquire and release scripts on a plain connection, as another program would send them.
pub struct RawScripts {
    acquire: redis::Script,
    release: redis::Script,
    ids: AtomicU64,
}

impl RawScripts {
    pub fn new() -> Self {
        RawScripts {
            acquire: redis::Script::new(lua::ACQUIRE),
            release: redis::Script::new(lua::RELEASE),
            ids: AtomicU64::new(0),
        }
    }

    /// One pair on `connection` for `key`: `EVALSHA` acquire, `EVALSHA` release.
    pub async fn pair(&self, connection: &mut MultiplexedConnection, key: &str) {
        let names = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, key);
        let holder = format!("{:032x}", self.ids.fetch_add(1, Ordering::Relaxed));
        let token: i64 = self
            .acquire
            .key(&names.lock)
            .key(&names.readers)
            .key(&names.intent)
            .key(&names.fence)
            .arg(&holder)
            .arg(LEASE_MS)
            .arg(INTENT_MS)
            .invoke_async(connection)
            .await
            .expect("raw acquire");
        assert!(token > 0, "the raw lock was busy");
        let released: i64 = self
            .release
            .key(&names.lock)
            .arg(&holder)
            .arg(&names.released)
            .invoke_async(connection)
            .await
            .expect("raw release");
        assert_eq!(released, 1, "the raw release was refused");
    }
}

impl Default for RawScripts {
    fn default() -> Self {
        Self::new()
    }
}

/// Measures `pairs` pairs of each variant, interleaved in a fresh order every round, after a
/// warm-up.
pub async fn measure(server: &RedisServer, pairs: usize) -> RedisPairs {
    let pid = std::process::id();
    let locks = lock(server);
    let bare = backend(server);
    let raw = RawScripts::new();
    let mut connection = server.client().await;
    let keys = [
        format!("bench/redis/lockingkit/{pid}"),
        format!("bench/redis/raw/{pid}"),
        format!("bench/redis/backend/{pid}"),
    ];
    let mut samples: [Vec<Duration>; 3] = Default::default();
    let warm_up = 100.min(pairs);
    let mut order = [0usize, 1, 2];
    let mut random = Shuffle::seeded();
    for round in 0..warm_up + pairs {
        random.shuffle(&mut order);
        for variant in order {
            let key = &keys[variant];
            let started = Instant::now();
            match variant {
                0 => locks
                    .try_acquire(key)
                    .await
                    .expect("lockingkit acquire")
                    .release()
                    .await
                    .expect("lockingkit release"),
                1 => raw.pair(&mut connection, key).await,
                _ => {
                    let acquired = bare
                        .try_acquire(key, LockMode::Exclusive)
                        .await
                        .expect("backend acquire")
                        .expect("the backend's lock was busy");
                    bare.release(&acquired.lease)
                        .await
                        .expect("backend release");
                }
            }
            if round >= warm_up {
                samples[variant].push(started.elapsed());
            }
        }
    }
    let [kit, raw, backend_only] = samples.map(Percentiles::of);
    RedisPairs {
        pairs,
        lockingkit: kit,
        raw,
        backend_only,
    }
}

/// The number of raw connections, as the baseline pool.
const RAW_POOL: usize = 16;

/// Alternates `rounds` rounds of LockingKit and raw pairs, `length` each, `tasks` at once; the
/// connections each side used are counted by the server, which should have no other clients.
pub async fn throughput(
    server: &RedisServer,
    tasks: usize,
    rounds: usize,
    length: Duration,
) -> Throughput {
    let pid = std::process::id();
    let others = clients(server);
    let locks = lock(server);
    let raw = Arc::new(RawScripts::new());
    let kit_pair = {
        let locks = locks.clone();
        move |task: usize, _round: u64| {
            let locks = locks.clone();
            async move {
                let key = format!("bench/redis/throughput/{pid}/{task}");
                locks
                    .try_acquire(&key)
                    .await
                    .expect("a key of its own is free")
                    .release()
                    .await
                    .expect("release");
            }
        }
    };
    pairs_for(tasks, Duration::from_millis(200), kit_pair.clone()).await;
    let lockingkit_connections = clients(server).saturating_sub(others);
    let mut pool = Vec::with_capacity(RAW_POOL);
    for _ in 0..RAW_POOL {
        pool.push(Mutex::new(server.client().await));
    }
    let pool = Arc::new(pool);
    let checkout = Arc::new(tokio::sync::Semaphore::new(RAW_POOL));
    let next = Arc::new(AtomicU64::new(0));
    let raw_pair = move |task: usize, _round: u64| {
        let (raw, pool, checkout, next) =
            (raw.clone(), pool.clone(), checkout.clone(), next.clone());
        async move {
            let key = format!("bench/redis/raw-throughput/{pid}/{task}");
            // A pool hands out a free connection for the whole pair.
            let _permit = checkout.acquire().await.expect("the pool");
            let mut connection = loop {
                let at = next.fetch_add(1, Ordering::Relaxed) as usize % RAW_POOL;
                if let Ok(connection) = pool[at].try_lock() {
                    break connection;
                }
            };
            raw.pair(&mut connection, &key).await;
        }
    };
    pairs_for(tasks, Duration::from_millis(200), raw_pair.clone()).await;
    let (mut kit, mut raw) = (0, 0);
    for _ in 0..rounds {
        kit += pairs_for(tasks, length, kit_pair.clone()).await;
        raw += pairs_for(tasks, length, raw_pair.clone()).await;
    }
    let seconds = length.as_secs_f64() * rounds as f64;
    Throughput {
        lockingkit_pairs_per_s: kit as f64 / seconds,
        lockingkit_connections,
        raw_pairs_per_s: raw as f64 / seconds,
        raw_connections: RAW_POOL,
    }
}

/// How many clients the server has, besides the `redis-cli` that asks.
fn clients(server: &RedisServer) -> usize {
    server
        .cli(&["CLIENT", "LIST"])
        .lines()
        .filter(|line| !line.contains("cmd=client"))
        .count()
}
