//! What a transaction-scoped lock costs over the raw statement: `PostgresTransactionLocks::
//! try_acquire` inside an open transaction next to raw `pg_try_advisory_xact_lock` statements
//! in the same kind of transaction, interleaved in one run against one server.
//!
//! Each sample opens a transaction (BEGIN, not timed), times the one lock statement, and
//! commits (not timed), which frees the key for the next sample: a lock per transaction, as
//! services take them. Every variant has a connection of its own. Two paths, each against the
//! raw statement sent the same way:
//!
//! - **unnamed**: `try_acquire` on a tokio-postgres `Transaction`, one unnamed statement with
//!   its parameter's type (`query_typed`), against raw `SELECT pg_try_advisory_xact_lock($1)`
//!   sent the same way;
//! - **prepared**: `try_acquire` on a deadpool-postgres `Transaction` (the `deadpool` feature),
//!   prepared once per connection through the pool's statement cache, against the raw
//!   statement through `prepare_cached` on a deadpool-postgres transaction, as a service would;
//!
//! and, to split the library's cost from its SQL's, LockingKit's own statement (isolation and
//! sequence checks, the fencing token) sent by hand both ways.

use std::time::Duration;

use deadpool_postgres::{Object, Pool};
use lockingkit::keys::PostgresLockKeys;
use lockingkit::providers::postgres::{
    LockableTransaction, PostgresTransactionLocks, PostgresTransactionOptions,
};
use lockingkit_tests::postgres::PostgresServer;
use tokio::sync::Mutex;
use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::samples::{interleaved, timed, Order, Percentiles, Rounds};
use crate::table::latency_line;

const TRY_XACT_LOCK: &str = "SELECT pg_try_advisory_xact_lock($1)";

/// LockingKit's statement, as the docs print it (docs/postgres.md, *The statement*).
fn lockingkit_statement() -> String {
    let options = PostgresTransactionOptions::default();
    let sequence = format!("{}.{}", options.fencing_schema, options.fencing_sequence);
    format!(
        "SELECT CASE current_setting('transaction_isolation') \
         WHEN 'repeatable read' THEN -1 WHEN 'serializable' THEN -2 \
         ELSE CASE WHEN to_regclass('{sequence}') IS NULL THEN -3 \
         WHEN pg_try_advisory_xact_lock($1) THEN nextval(to_regclass('{sequence}')) ELSE 0 END END"
    )
}

/// The latencies of one run.
#[derive(Clone, Debug)]
pub struct TransactionBenchReport {
    /// Samples per variant.
    pub samples: usize,
    /// `try_acquire` on a tokio-postgres transaction (unnamed).
    pub lockingkit_unnamed: Percentiles,
    /// The raw try-lock sent unnamed: the unnamed path's baseline.
    pub raw_unnamed: Percentiles,
    /// `try_acquire` on a deadpool-postgres transaction (prepared).
    pub lockingkit_prepared: Percentiles,
    /// The raw try-lock through `prepare_cached`: the prepared path's baseline.
    pub raw_prepared: Percentiles,
    /// LockingKit's statement sent unnamed by hand.
    pub same_unnamed: Percentiles,
    /// LockingKit's statement through `prepare_cached` by hand.
    pub same_prepared: Percentiles,
}

impl TransactionBenchReport {
    /// The unnamed path over the raw unnamed statement (the goal is at most 1.10).
    pub fn unnamed_ratio(&self) -> f64 {
        self.lockingkit_unnamed.ratio_to(self.raw_unnamed)
    }

    /// The prepared path over the raw prepared statement (the goal is at most 1.10).
    pub fn prepared_ratio(&self) -> f64 {
        self.lockingkit_prepared.ratio_to(self.raw_prepared)
    }

    /// The unnamed path over its own statement sent the same way by hand: the library's cost.
    pub fn unnamed_library_ratio(&self) -> f64 {
        self.lockingkit_unnamed.ratio_to(self.same_unnamed)
    }

    /// The prepared path over its own statement prepared by hand: the library's cost.
    pub fn prepared_library_ratio(&self) -> f64 {
        self.lockingkit_prepared.ratio_to(self.same_prepared)
    }

    /// A few lines for humans.
    pub fn render(&self) -> String {
        let line = |name: &str, latency: Percentiles| latency_line(name, 52, latency);
        format!(
            "PostgreSQL transaction-scoped try-lock inside an open transaction, {} interleaved samples each:\n{}{}{}{}{}{}",
            self.samples,
            line("lockingkit on a tokio-postgres transaction (unnamed)", self.lockingkit_unnamed),
            line("raw pg_try_advisory_xact_lock, unnamed", self.raw_unnamed),
            line("lockingkit on a deadpool-postgres transaction (prepared)", self.lockingkit_prepared),
            line("raw pg_try_advisory_xact_lock, prepare_cached", self.raw_prepared),
            line("lockingkit's statement by hand, unnamed", self.same_unnamed),
            line("lockingkit's statement by hand, prepare_cached", self.same_prepared),
        )
    }
}

/// The variants, in the order of [`TransactionBenchReport`]'s fields.
#[derive(Clone, Copy)]
enum Variant {
    LockingkitUnnamed,
    RawUnnamed,
    LockingkitPrepared,
    RawPrepared,
    SameUnnamed,
    SamePrepared,
}

const VARIANTS: [Variant; 6] = [
    Variant::LockingkitUnnamed,
    Variant::RawUnnamed,
    Variant::LockingkitPrepared,
    Variant::RawPrepared,
    Variant::SameUnnamed,
    Variant::SamePrepared,
];

/// The connection of one variant: a plain client, or a deadpool-postgres object.
enum Connection {
    Plain(Client),
    Pooled(Object),
}

/// What every sample needs.
struct Bench {
    locks: PostgresTransactionLocks,
    statement: String,
    key: String,
    advisory: i64,
}

impl Bench {
    /// One timed lock statement of `variant` in a transaction of its own on `connection`.
    async fn sample(&self, variant: Variant, connection: &mut Connection) -> Duration {
        match connection {
            Connection::Plain(client) => {
                let transaction = client.transaction().await.expect("BEGIN");
                let elapsed = self.time(variant, &transaction).await;
                transaction.commit().await.expect("COMMIT");
                elapsed
            }
            Connection::Pooled(object) => {
                let transaction = object.transaction().await.expect("BEGIN");
                let elapsed = self.time(variant, &transaction).await;
                transaction.commit().await.expect("COMMIT");
                elapsed
            }
        }
    }

    async fn time<T: LockableTransaction + RawStatements>(
        &self,
        variant: Variant,
        transaction: &T,
    ) -> Duration {
        timed(async {
            match variant {
                Variant::LockingkitUnnamed | Variant::LockingkitPrepared => {
                    let lock = self.locks.try_acquire(transaction, &self.key).await;
                    lock.expect("the lockingkit key was busy");
                }
                Variant::RawUnnamed | Variant::RawPrepared => {
                    let taken = transaction.raw_bool(TRY_XACT_LOCK, self.advisory).await;
                    assert!(taken, "raw key busy");
                }
                Variant::SameUnnamed | Variant::SamePrepared => {
                    let token = transaction.raw_i64(&self.statement, self.advisory).await;
                    assert!(token > 0, "raw fenced key busy: {token}");
                }
            }
        })
        .await
    }
}

/// The raw statement sent the way each transaction type sends LockingKit's: unnamed on a
/// tokio-postgres transaction, through `prepare_cached` on a deadpool-postgres one.
trait RawStatements {
    async fn raw_row(&self, sql: &str, key: i64) -> tokio_postgres::Row;

    async fn raw_bool(&self, sql: &str, key: i64) -> bool {
        self.raw_row(sql, key).await.get(0)
    }

    async fn raw_i64(&self, sql: &str, key: i64) -> i64 {
        self.raw_row(sql, key).await.get(0)
    }
}

impl RawStatements for tokio_postgres::Transaction<'_> {
    async fn raw_row(&self, sql: &str, key: i64) -> tokio_postgres::Row {
        self.query_typed_one(sql, &[(&key, Type::INT8)])
            .await
            .expect("raw statement")
    }
}

impl RawStatements for deadpool_postgres::Transaction<'_> {
    async fn raw_row(&self, sql: &str, key: i64) -> tokio_postgres::Row {
        let statement = self
            .prepare_typed_cached(sql, &[Type::INT8])
            .await
            .expect("prepare");
        self.query_one(&statement, &[&key])
            .await
            .expect("raw statement")
    }
}

/// A connection for `variant`: deadpool-postgres objects for the prepared ones.
async fn connection_for(
    variant: Variant,
    server: &PostgresServer,
    pools: &mut Vec<Pool>,
) -> Connection {
    match variant {
        Variant::LockingkitUnnamed | Variant::RawUnnamed | Variant::SameUnnamed => {
            Connection::Plain(server.connect().await)
        }
        Variant::LockingkitPrepared | Variant::RawPrepared | Variant::SamePrepared => {
            let pool = server.plain_pool(1);
            let object = pool.get().await.expect("a pooled connection");
            pools.push(pool);
            Connection::Pooled(object)
        }
    }
}

/// Measures `samples` lock statements of each variant, interleaved, after a warm-up.
pub async fn measure_transaction(
    server: &PostgresServer,
    samples: usize,
) -> TransactionBenchReport {
    let locks = PostgresTransactionLocks::default();
    locks
        .create_fencing_sequence(&server.connect().await)
        .await
        .expect("fencing sequence");
    let mut pools = Vec::new();
    let mut connections = Vec::new();
    for variant in VARIANTS {
        connections.push(Mutex::new(
            connection_for(variant, server, &mut pools).await,
        ));
    }
    // One key for all: each sample's transaction holds it only while that sample runs.
    let key = format!("bench/transaction/{}", std::process::id());
    let bench = Bench {
        locks,
        statement: lockingkit_statement(),
        advisory: PostgresLockKeys::advisory_key(&key),
        key,
    };

    let rounds = Rounds::new(samples, 50, Order::Shuffled);
    let measured: [Vec<Duration>; VARIANTS.len()] = interleaved(rounds, |index| {
        let (bench, connections) = (&bench, &connections);
        async move {
            let mut connection = connections[index].lock().await;
            bench.sample(VARIANTS[index], &mut connection).await
        }
    })
    .await;
    let [lockingkit_unnamed, raw_unnamed, lockingkit_prepared, raw_prepared, same_unnamed, same_prepared] =
        measured.map(Percentiles::of);
    TransactionBenchReport {
        samples,
        lockingkit_unnamed,
        raw_unnamed,
        lockingkit_prepared,
        raw_prepared,
        same_unnamed,
        same_prepared,
    }
}
