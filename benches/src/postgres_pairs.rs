//! What LockingKit adds to a PostgreSQL advisory-lock round trip: `try_acquire` + `release`
//! through the lock next to raw prepared statements, interleaved in one run against one server.
//!
//! Per pair, LockingKit checks a connection out of its pool, runs the prepared
//! `SELECT nextval(…) FROM (SELECT pg_try_advisory_lock($1) …) WHERE ok` (lock and fencing
//! token in one round trip), lets the engine start keeping the lock, runs the prepared
//! `pg_advisory_unlock($1)` and returns the connection to the pool: two round trips, like the
//! baselines.
//!
//! - **raw pooled** (the reference): a deadpool-postgres pool of one connection, one checkout
//!   per pair, cached prepared `pg_try_advisory_lock($1)` and `pg_advisory_unlock($1)`;
//! - **raw dedicated**: one client held for the whole run, statements prepared once;
//! - **raw with fencing**: raw pooled, but locking with LockingKit's statement: what the
//!   fencing token costs the server;
//! - **backend alone**: `PostgresBackend` through the `LockBackend` trait without the engine:
//!   what the provider adds over raw with fencing, and, against `lockingkit`, what the engine
//!   adds (waiting room, the task that checks the held connection, telemetry).
//!
//! The variants run in a fresh random order every round, inside a runtime task, as
//! application code would.
//!
//! For profiling, `LOCKINGKIT_BENCH_VARIANT=<n>` runs variant `n` alone (0 LockingKit, 1 raw
//! pooled, 2 raw dedicated, 3 raw with fencing, 4 backend alone); the others report zero.

use std::time::Duration;

use deadpool_postgres::Pool;
use lockingkit::keys::PostgresLockKeys;
use lockingkit::providers::postgres::{DEFAULT_FENCING_SCHEMA, DEFAULT_FENCING_SEQUENCE};
use lockingkit::{DistributedLock, PostgresBackend, PostgresOptions};
use lockingkit_tests::postgres::PostgresServer;
use tokio_postgres::types::ToSql;

use crate::pair::{backend_pair, lock_on, lock_pair};
use crate::samples::{interleaved, timed, Order, Percentiles, Rounds};
use crate::table::latency_line;

/// Names the one variant to run, for profiling it alone.
const VARIANT_ENV: &str = "LOCKINGKIT_BENCH_VARIANT";

/// The raw try-lock and unlock of one key, as an application would send them by hand.
pub(crate) const TRY_LOCK: &str = "SELECT pg_try_advisory_lock($1)";
pub(crate) const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";

/// The PostgreSQL provider with `options`.
pub fn backend(options: PostgresOptions) -> PostgresBackend {
    PostgresBackend::new(options).expect("options")
}

/// The latencies of one run.
#[derive(Clone, Debug)]
pub struct PostgresBenchReport {
    /// Pairs measured per variant.
    pub pairs: usize,
    /// LockingKit `try_acquire` + `release`.
    pub lockingkit: Percentiles,
    /// Raw prepared try-lock + unlock on a connection checked out of a pool.
    pub raw_pooled: Percentiles,
    /// Raw prepared try-lock + unlock on one client held throughout.
    pub raw_dedicated: Percentiles,
    /// Raw prepared lock-with-fencing statement + unlock on a pooled connection: the server's
    /// share of LockingKit's cost.
    pub raw_fenced: Percentiles,
    /// The PostgreSQL backend alone (`LockBackend::try_acquire` + `release`), without the
    /// engine: the engine's share is the difference to `lockingkit`.
    pub backend_only: Percentiles,
}

impl PostgresBenchReport {
    /// LockingKit's median over the raw pooled median (the goal is at most 1.10).
    pub fn ratio(&self) -> f64 {
        self.lockingkit.ratio_to(self.raw_pooled)
    }

    /// LockingKit's median over the dedicated client's.
    pub fn ratio_to_dedicated(&self) -> f64 {
        self.lockingkit.ratio_to(self.raw_dedicated)
    }

    /// LockingKit's median over raw SQL doing the same work, fencing included.
    pub fn fenced_ratio(&self) -> f64 {
        self.lockingkit.ratio_to(self.raw_fenced)
    }

    /// A few lines for humans.
    pub fn render(&self) -> String {
        let line = |name: &str, latency: Percentiles| latency_line(name, 38, latency);
        format!(
            "PostgreSQL acquire+release over loopback TCP, {} interleaved pairs each:\n{}{}{}{}{}  \
             ratio lockingkit / raw pooled (median)   {:.3} (goal <= 1.10)\n  \
             ratio lockingkit / raw dedicated (median) {:.3}",
            self.pairs,
            line("lockingkit try_acquire+release", self.lockingkit),
            line("raw prepared, pooled connection", self.raw_pooled),
            line("raw prepared, dedicated connection", self.raw_dedicated),
            line("raw prepared with fencing, pooled", self.raw_fenced),
            line("PostgresBackend alone (no engine)", self.backend_only),
            self.ratio(),
            self.ratio_to_dedicated(),
        )
    }
}

/// Measures `pairs` pairs of each variant, interleaved in a fresh order every round, after a
/// warm-up.
pub async fn measure(server: &PostgresServer, pairs: usize) -> PostgresBenchReport {
    let variants = PairVariants::connect(server).await;
    let only: Option<usize> = std::env::var(VARIANT_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok());
    let rounds = Rounds::new(pairs, 50, Order::Shuffled).only(only);
    let samples = interleaved(rounds, |variant| timed(variants.pair(variant))).await;
    let [kit, pooled, dedicated, fenced, backend_only] = samples.map(Percentiles::of);
    PostgresBenchReport {
        pairs,
        lockingkit: kit,
        raw_pooled: pooled,
        raw_dedicated: dedicated,
        raw_fenced: fenced,
        backend_only,
    }
}

/// The five variants `measure` compares, each with a key and a connection of its own, so
/// none is warmer for being used more often.
struct PairVariants {
    dedicated: tokio_postgres::Client,
    try_lock: tokio_postgres::Statement,
    unlock: tokio_postgres::Statement,
    dedicated_key: i64,
    pool: Pool,
    pooled_key: i64,
    fenced_pool: Pool,
    fenced_key: i64,
    fenced_lock: String,
    bare: PostgresBackend,
    bare_key: String,
    locks: DistributedLock,
    kit_key: String,
}

impl PairVariants {
    async fn connect(server: &PostgresServer) -> PairVariants {
        let pid = std::process::id();
        let locks = lock_on(backend(server.options(Duration::from_secs(5))));
        let kit_key = format!("bench/lockingkit/{pid}");
        let bare = backend(server.options(Duration::from_secs(5)));
        let bare_key = format!("bench/backend/{pid}");
        let pool = server.plain_pool(1);
        let fenced_pool = server.plain_pool(1);
        let pooled_key = PostgresLockKeys::advisory_key(&format!("bench/pooled/{pid}"));
        let fenced_key = PostgresLockKeys::advisory_key(&format!("bench/fenced/{pid}"));
        let fenced_lock = format!(
            "SELECT nextval('{}.{}') FROM (SELECT pg_try_advisory_lock($1) AS ok OFFSET 0) s WHERE ok",
            DEFAULT_FENCING_SCHEMA, DEFAULT_FENCING_SEQUENCE
        );
        let dedicated = server.connect().await;
        let try_lock = dedicated.prepare(TRY_LOCK).await.expect("prepare");
        let unlock = dedicated.prepare(UNLOCK).await.expect("prepare");
        let dedicated_key = PostgresLockKeys::advisory_key(&format!("bench/dedicated/{pid}"));

        // The first LockingKit attempt creates the fencing sequence the raw fenced variant uses.
        lock_pair(&locks, &kit_key).await;
        PairVariants {
            dedicated,
            try_lock,
            unlock,
            dedicated_key,
            pool,
            pooled_key,
            fenced_pool,
            fenced_key,
            fenced_lock,
            bare,
            bare_key,
            locks,
            kit_key,
        }
    }

    /// One pair of `variant`: 0 LockingKit, 1 raw pooled, 2 raw dedicated, 3 raw with
    /// fencing, 4 the backend alone.
    async fn pair(&self, variant: usize) {
        match variant {
            0 => lock_pair(&self.locks, &self.kit_key).await,
            1 => raw_pair(&self.pool, TRY_LOCK, UNLOCK, &[&self.pooled_key]).await,
            2 => self.dedicated_pair().await,
            3 => {
                raw_pair(
                    &self.fenced_pool,
                    &self.fenced_lock,
                    UNLOCK,
                    &[&self.fenced_key],
                )
                .await
            }
            _ => backend_pair(&self.bare, &self.bare_key).await,
        }
    }

    async fn dedicated_pair(&self) {
        let answer = |statement| async move {
            let key = &self.dedicated_key;
            let row = self.dedicated.query_one(statement, &[key]).await;
            row.expect("raw statement").get::<_, bool>(0)
        };
        assert!(
            answer(&self.try_lock).await,
            "the raw dedicated lock was busy"
        );
        assert!(
            answer(&self.unlock).await,
            "the raw dedicated unlock was refused"
        );
    }
}

/// One raw pair on a connection checked out of `pool` for it: `lock` (answering a row when
/// taken: `true`, or a fencing token) then `unlock`, both with `params` and prepared once per
/// connection through the pool's statement cache.
pub(crate) async fn raw_pair(
    pool: &Pool,
    lock: &str,
    unlock: &str,
    params: &[&(dyn ToSql + Sync)],
) {
    let client = pool.get().await.expect("pooled connection");
    let lock = client.prepare_cached(lock).await.expect("prepare");
    let unlock = client.prepare_cached(unlock).await.expect("prepare");
    let row = client
        .query_opt(&lock, params)
        .await
        .expect("raw lock")
        .expect("the raw lock answered no row");
    if let Ok(taken) = row.try_get::<_, bool>(0) {
        assert!(taken, "the raw lock was busy");
    }
    let released: bool = client
        .query_one(&unlock, params)
        .await
        .expect("raw unlock")
        .get(0);
    assert!(released, "the raw unlock was refused");
}
