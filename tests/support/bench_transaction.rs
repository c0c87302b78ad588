//! What a transaction-scoped lock costs over the raw statement: `PostgresTransactionLocks::
//! try_acquire` inside an open transaction next to raw `pg_try_advisory_xact_lock` statements
//! in the same kind of transaction, interleaved in one run against one server.
//!
//! Each sample opens a transaction (BEGIN, not timed), times the one lock statement, and
//! commits (not timed), which frees the key for the next sample: a lock per transaction, as
//! services take them. Every variant has a connection of its own.
//!
//! - **lockingkit**: `try_acquire(&transaction, key)`: one unnamed statement with its parameter's
//!   type (tokio-postgres `query_typed`), which takes the lock and the fencing token;
//! - **raw prepared** (the reference): `SELECT pg_try_advisory_xact_lock($1)`, prepared once
//!   on its connection, as `prepare_cached` on a deadpool-postgres client would;
//! - **raw prepared with fencing**: LockingKit's statement, prepared: what the token costs;
//! - **raw unnamed**: `SELECT pg_try_advisory_xact_lock($1)` sent as LockingKit sends its
//!   statement: what parsing each time costs;
//! - **raw unnamed with fencing**: LockingKit's very statement, sent the same way without the
//!   library: what the library itself adds.

use std::time::{Duration, Instant};

use lockingkit::keys::PostgresLockKeys;
use lockingkit::{PostgresTransactionLocks, PostgresTransactionOptions};
use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::bench_postgres::{Latency, Shuffle};
use crate::postgres::PostgresServer;

const TRY_XACT_LOCK: &str = "SELECT pg_try_advisory_xact_lock($1)";

/// The latencies of one run.
#[derive(Clone, Debug)]
pub struct TransactionBenchReport {
    /// Samples per variant.
    pub samples: usize,
    pub lockingkit: Latency,
    pub raw_prepared: Latency,
    pub raw_prepared_fenced: Latency,
    pub raw_unnamed: Latency,
    pub raw_unnamed_fenced: Latency,
}

impl TransactionBenchReport {
    /// LockingKit's median over the raw prepared statement's (the goal is at most 1.10).
    pub fn ratio(&self) -> f64 {
        ratio(self.lockingkit, self.raw_prepared)
    }

    /// LockingKit's median over the raw prepared statement doing the same work.
    pub fn ratio_to_fenced(&self) -> f64 {
        ratio(self.lockingkit, self.raw_prepared_fenced)
    }

    /// LockingKit's median over its own statement sent the same way by hand.
    pub fn ratio_to_same_statement(&self) -> f64 {
        ratio(self.lockingkit, self.raw_unnamed_fenced)
    }

    /// A few lines for humans.
    pub fn render(&self) -> String {
        let line = |name: &str, l: Latency| {
            format!(
                "  {name:<44} median {:>8.1} µs   p99 {:>8.1} µs\n",
                micros(l.median),
                micros(l.p99)
            )
        };
        format!(
            "PostgreSQL transaction-scoped try-lock inside an open transaction, {} interleaved samples each:\n{}{}{}{}{}",
            self.samples,
            line("lockingkit try_acquire(&transaction, key)", self.lockingkit),
            line("raw prepared pg_try_advisory_xact_lock", self.raw_prepared),
            line("raw prepared, with fencing (same SQL)", self.raw_prepared_fenced),
            line("raw unnamed pg_try_advisory_xact_lock", self.raw_unnamed),
            line("raw unnamed, with fencing (same statement)", self.raw_unnamed_fenced),
        )
    }
}

fn ratio(a: Latency, b: Latency) -> f64 {
    a.median.as_secs_f64() / b.median.as_secs_f64()
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The five ways of taking the lock, by variant number.
struct Variants {
    locks: PostgresTransactionLocks,
    try_lock: tokio_postgres::Statement,
    fenced_lock: tokio_postgres::Statement,
    fenced: String,
}

impl Variants {
    /// One lock statement of `variant` in `transaction`, on `key` (`advisory` for raw SQL).
    async fn run(
        &self,
        variant: usize,
        transaction: &tokio_postgres::Transaction<'_>,
        key: &str,
        advisory: i64,
    ) {
        match variant {
            0 => {
                let lock = self.locks.try_acquire(transaction, key).await;
                lock.expect("the lockingkit key was busy");
            }
            1 => {
                let row = transaction.query_one(&self.try_lock, &[&advisory]).await;
                assert!(row.expect("raw lock").get::<_, bool>(0), "raw key busy");
            }
            2 => {
                let row = transaction.query_opt(&self.fenced_lock, &[&advisory]).await;
                row.expect("raw fenced lock").expect("raw fenced key busy");
            }
            3 => {
                let row = transaction
                    .query_typed_one(TRY_XACT_LOCK, &[(&advisory, Type::INT8)])
                    .await;
                assert!(row.expect("raw lock").get::<_, bool>(0), "raw key busy");
            }
            _ => {
                let row = transaction
                    .query_typed_opt(&self.fenced, &[(&advisory, Type::INT8)])
                    .await;
                row.expect("raw fenced lock").expect("raw fenced key busy");
            }
        }
    }
}

/// Measures `samples` lock statements of each variant, interleaved, after a warm-up.
pub async fn measure_transaction(
    server: &PostgresServer,
    samples: usize,
) -> TransactionBenchReport {
    const VARIANTS: usize = 5;
    let locks = PostgresTransactionLocks::default();
    let fenced = format!(
        "SELECT nextval('{}.{}') WHERE pg_try_advisory_xact_lock($1)",
        PostgresTransactionOptions::default().fencing_schema,
        PostgresTransactionOptions::default().fencing_sequence
    );
    let mut clients = Vec::new();
    for _ in 0..VARIANTS {
        clients.push(server.connect().await);
    }
    locks
        .create_fencing_sequence(&clients[0])
        .await
        .expect("fencing sequence");
    let variants = Variants {
        try_lock: clients[1].prepare(TRY_XACT_LOCK).await.expect("prepare"),
        fenced_lock: clients[2].prepare(&fenced).await.expect("prepare"),
        fenced,
        locks,
    };
    let pid = std::process::id();
    let keys: Vec<String> = (0..VARIANTS)
        .map(|v| format!("bench/transaction/{v}/{pid}"))
        .collect();
    let advisory: Vec<i64> = keys
        .iter()
        .map(|k| PostgresLockKeys::advisory_key(k))
        .collect();

    let mut measured: [Vec<Duration>; VARIANTS] = Default::default();
    let warm_up = 50.min(samples);
    let mut order: [usize; VARIANTS] = std::array::from_fn(|v| v);
    let mut random = Shuffle::seeded();
    for round in 0..warm_up + samples {
        random.shuffle(&mut order);
        for variant in order {
            let client: &mut Client = &mut clients[variant];
            let transaction = client.transaction().await.expect("BEGIN");
            let started = Instant::now();
            variants
                .run(variant, &transaction, &keys[0], advisory[variant])
                .await;
            let elapsed = started.elapsed();
            transaction.commit().await.expect("COMMIT");
            if round >= warm_up {
                measured[variant].push(elapsed);
            }
        }
    }
    let [lockingkit, raw_prepared, raw_prepared_fenced, raw_unnamed, raw_unnamed_fenced] =
        measured.map(crate::bench_postgres::latency);
    TransactionBenchReport {
        samples,
        lockingkit,
        raw_prepared,
        raw_prepared_fenced,
        raw_unnamed,
        raw_unnamed_fenced,
    }
}
