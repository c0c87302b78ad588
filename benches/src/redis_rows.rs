//! What LockingKit adds to a Redis lock's round trips, measured next to the very same Lua scripts
//! sent raw, interleaved in one run against one throwaway server (`benches/benches/lockingkit.rs`
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
use std::time::Duration;

use lockingkit::keys::RedisLockKeys;
use lockingkit::providers::redis::lua;
use lockingkit::{DistributedLock, RedisBackend, RedisOptions};
use lockingkit_tests::redis::RedisServer;
use redis::aio::MultiplexedConnection;
use tokio::sync::Mutex;

use crate::load::{alternating, pairs_for, Throughput, WARM_UP};
use crate::pair::{backend_pair, lock_on, lock_pair};
use crate::samples::{interleaved, timed, Order, Percentiles, Rounds};

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
    lock_on(backend(server))
}

/// The same, with the provider's wait hidden: waiters in other processes only poll.
pub fn polling_lock(server: &RedisServer) -> DistributedLock {
    crate::handoff::polling_lock(backend(server))
}

/// The latencies of one run.
#[derive(Clone, Copy, Debug)]
pub struct RedisPairs {
    /// Pairs measured per variant.
    pub pairs: usize,
    /// LockingKit `try_acquire` + `release`.
    pub lockingkit: Percentiles,
    /// The same scripts sent raw.
    pub raw: Percentiles,
    /// The Redis backend alone, without the engine.
    pub backend_only: Percentiles,
}

impl RedisPairs {
    /// LockingKit's median over the raw scripts' (the goal is at most 1.10).
    pub fn ratio(&self) -> f64 {
        self.lockingkit.ratio_to(self.raw)
    }
}

/// The acquire and release scripts on a plain connection, as another program would send them.
pub struct RawScripts {
    acquire: redis::Script,
    release: redis::Script,
    ids: AtomicU64,
}

impl RawScripts {
    /// The provider's scripts, not loaded yet: the first `EVALSHA` that misses loads them.
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
    let connection = server.client().await;
    let keys = [
        format!("bench/redis/lockingkit/{pid}"),
        format!("bench/redis/raw/{pid}"),
        format!("bench/redis/backend/{pid}"),
    ];
    let rounds = Rounds::new(pairs, 100, Order::Shuffled);
    let samples = interleaved(rounds, |variant| {
        let key = &keys[variant];
        // A clone shares the one multiplexed connection.
        let mut connection = connection.clone();
        let (locks, bare, raw) = (&locks, &bare, &raw);
        async move {
            match variant {
                0 => timed(lock_pair(locks, key)).await,
                1 => timed(raw.pair(&mut connection, key)).await,
                _ => timed(backend_pair(bare, key)).await,
            }
        }
    })
    .await;
    let [lockingkit, raw, backend_only] = samples.map(Percentiles::of);
    RedisPairs {
        pairs,
        lockingkit,
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
            async move { lock_pair(&locks, &format!("bench/redis/throughput/{pid}/{task}")).await }
        }
    };
    pairs_for(tasks, WARM_UP, kit_pair.clone()).await;
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
    pairs_for(tasks, WARM_UP, raw_pair.clone()).await;
    let (kit_per_s, raw_per_s) = alternating(tasks, rounds, length, kit_pair, raw_pair).await;
    Throughput {
        lockingkit_pairs_per_s: kit_per_s,
        lockingkit_connections,
        raw_pairs_per_s: raw_per_s,
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
