//! What LockingKit adds to a PostgreSQL advisory-lock round trip: `try_acquire` + `release`
//! through the lock next to raw prepared statements, interleaved in one run against one server.
//!
//! Per pair, LockingKit checks a connection out of its pool, runs the prepared
//! `SELECT nextval(…) FROM (SELECT pg_try_advisory_lock($1) …) WHERE ok` (lock and fencing
//! token in one round trip), starts the connection check timer, runs the prepared
//! `pg_advisory_unlock($1)` and returns the connection to the pool: two round trips. The
//! baselines send the same two round trips without fencing:
//! - **raw pooled**: a deadpool-postgres pool, one checkout per pair, cached prepared
//!   `pg_try_advisory_lock($1)` and `pg_advisory_unlock($1)` — what an application would write;
//! - **raw dedicated**: one client held for the whole run with the statements prepared once —
//!   the floor.

use std::time::{Duration, Instant};

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use lockingkit::{DistributedLock, PostgresBackend, PostgresLockKeys};

use crate::postgres::PostgresServer;

const TRY_LOCK: &str = "SELECT pg_try_advisory_lock($1)";
const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";

/// Median and 99th percentile of one variant.
#[derive(Clone, Copy, Debug)]
pub struct Latency {
    pub median: Duration,
    pub p99: Duration,
}

/// The latencies of one run.
#[derive(Clone, Debug)]
pub struct PostgresBenchReport {
    /// Pairs measured per variant.
    pub pairs: usize,
    /// LockingKit `try_acquire` + `release`.
    pub lockingkit: Latency,
    /// Raw prepared try-lock + unlock on a connection checked out of a pool.
    pub raw_pooled: Latency,
    /// Raw prepared try-lock + unlock on one client held throughout.
    pub raw_dedicated: Latency,
}

impl PostgresBenchReport {
    /// LockingKit's median over the raw pooled median (the goal is at most 1.10).
    pub fn ratio(&self) -> f64 {
        self.lockingkit.median.as_secs_f64() / self.raw_pooled.median.as_secs_f64()
    }

    /// LockingKit's median over the dedicated client's.
    pub fn ratio_to_dedicated(&self) -> f64 {
        self.lockingkit.median.as_secs_f64() / self.raw_dedicated.median.as_secs_f64()
    }

    /// A few lines for humans.
    pub fn render(&self) -> String {
        let line = |name: &str, l: Latency| {
            format!(
                "  {name:<38} median {:>8.1} µs   p99 {:>8.1} µs\n",
                micros(l.median),
                micros(l.p99)
            )
        };
        format!(
            "PostgreSQL acquire+release over loopback TCP, {} interleaved pairs each:\n{}{}{}  \
             ratio lockingkit / raw pooled (median)   {:.3} (goal <= 1.10)\n  \
             ratio lockingkit / raw dedicated (median) {:.3}",
            self.pairs,
            line("lockingkit try_acquire+release", self.lockingkit),
            line("raw prepared, pooled connection", self.raw_pooled),
            line("raw prepared, dedicated connection", self.raw_dedicated),
            self.ratio(),
            self.ratio_to_dedicated(),
        )
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn latency(mut samples: Vec<Duration>) -> Latency {
    samples.sort_unstable();
    let at = |q: f64| {
        let index = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples.get(index).copied().unwrap_or_default()
    };
    Latency {
        median: at(0.5),
        p99: at(0.99),
    }
}

/// Measures `pairs` pairs of each variant, interleaved, after a warm-up.
pub async fn measure(server: &PostgresServer, pairs: usize) -> PostgresBenchReport {
    let backend = PostgresBackend::new(server.options(Duration::from_secs(5))).expect("options");
    let locks = DistributedLock::builder(backend).build().expect("lock");
    let kit_key = format!("bench/lockingkit/{}", std::process::id());

    let config: tokio_postgres::Config = server.connection_string().parse().expect("config");
    let manager = Manager::from_config(
        config,
        tokio_postgres::NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager).max_size(1).build().expect("pool");
    let pooled_key =
        PostgresLockKeys::advisory_key(&format!("bench/pooled/{}", std::process::id()));

    let dedicated = server.connect().await;
    let try_lock = dedicated.prepare(TRY_LOCK).await.expect("prepare");
    let unlock = dedicated.prepare(UNLOCK).await.expect("prepare");
    let dedicated_key =
        PostgresLockKeys::advisory_key(&format!("bench/dedicated/{}", std::process::id()));

    let mut samples = [Vec::new(), Vec::new(), Vec::new()];
    let warm_up = 50.min(pairs);
    for round in 0..warm_up + pairs {
        // Rotate the order so no variant always runs right after another.
        for slot in 0..3 {
            let variant = (round + slot) % 3;
            let started = Instant::now();
            match variant {
                0 => locks
                    .try_acquire(&kit_key)
                    .await
                    .expect("lockingkit acquire")
                    .release()
                    .await
                    .expect("lockingkit release"),
                1 => {
                    let client = pool.get().await.expect("pooled connection");
                    let try_lock = client.prepare_cached(TRY_LOCK).await.expect("prepare");
                    let unlock = client.prepare_cached(UNLOCK).await.expect("prepare");
                    let taken: bool = client
                        .query_one(&try_lock, &[&pooled_key])
                        .await
                        .expect("raw lock")
                        .get(0);
                    assert!(taken, "the raw pooled lock was busy");
                    let released: bool = client
                        .query_one(&unlock, &[&pooled_key])
                        .await
                        .expect("raw unlock")
                        .get(0);
                    assert!(released, "the raw pooled unlock was refused");
                }
                _ => {
                    let taken: bool = dedicated
                        .query_one(&try_lock, &[&dedicated_key])
                        .await
                        .expect("raw lock")
                        .get(0);
                    assert!(taken, "the raw dedicated lock was busy");
                    let released: bool = dedicated
                        .query_one(&unlock, &[&dedicated_key])
                        .await
                        .expect("raw unlock")
                        .get(0);
                    assert!(released, "the raw dedicated unlock was refused");
                }
            }
            if round >= warm_up {
                samples[variant].push(started.elapsed());
            }
        }
    }
    let [kit, pooled, dedicated] = samples;
    PostgresBenchReport {
        pairs,
        lockingkit: latency(kit),
        raw_pooled: latency(pooled),
        raw_dedicated: latency(dedicated),
    }
}
