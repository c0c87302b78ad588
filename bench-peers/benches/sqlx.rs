//! LockingKit's PostgreSQL try_acquire + release next to sqlx's `PgAdvisoryLock`, the most
//! used Rust PostgreSQL lock, and raw prepared tokio-postgres statements, interleaved in one run
//! against one throwaway server.
//!
//! ```text
//! scripts/setup-postgres.sh
//! cd bench-peers && cargo bench
//! ```
//!
//! Variants, in a fresh random order every round:
//! - LockingKit `try_acquire` + `release` with the default options;
//! - sqlx `PgAdvisoryLock::try_acquire` + `release_now` on a `PgPool` of 4, the checkout timed;
//! - sqlx on one dedicated `PgConnection`;
//! - raw prepared `pg_try_advisory_lock` + `pg_advisory_unlock` on one tokio-postgres client.

use std::time::{Duration, Instant};

use lockingkit::keys::PostgresLockKeys;
use lockingkit::{DistributedLock, PostgresBackend, PostgresOptions};
use lockingkit_benches::mode::{in_task, two_worker_runtime, BenchMode};
use lockingkit_benches::samples::{Percentiles, Shuffle};
use lockingkit_tests::postgres::PostgresServer;
use sqlx::postgres::{PgAdvisoryLock, PgConnectOptions, PgConnection, PgPoolOptions};
use sqlx::{ConnectOptions, Either};

const PAIRS: usize = 5000;
const WARM_UP: usize = 200;

fn median(samples: Vec<Duration>) -> Duration {
    Percentiles::of(samples).p50
}

fn main() {
    let Some(mode) = BenchMode::from_args() else {
        return;
    };
    let pairs = mode.pick(PAIRS, 20);
    in_task(&two_worker_runtime(), "the sqlx benchmark", measure(pairs));
}

async fn measure(pairs: usize) {
    let server = PostgresServer::start().await;
    let pid = std::process::id();
    let backend =
        PostgresBackend::new(PostgresOptions::new(server.connection_string())).expect("options");
    let locks = DistributedLock::builder(backend).build().expect("lock");
    let kit_key = format!("peers/lockingkit/{pid}");

    let options: PgConnectOptions = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
        server.port()
    )
    .parse()
    .expect("sqlx options");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.clone())
        .await
        .expect("sqlx pool");
    let pooled_lock = PgAdvisoryLock::new(format!("peers/sqlx-pool/{pid}"));
    let mut dedicated: PgConnection = options.connect().await.expect("sqlx connection");
    let dedicated_lock = PgAdvisoryLock::new(format!("peers/sqlx-dedicated/{pid}"));

    let raw = server.connect().await;
    let try_lock = raw
        .prepare("SELECT pg_try_advisory_lock($1)")
        .await
        .expect("prepare");
    let unlock = raw
        .prepare("SELECT pg_advisory_unlock($1)")
        .await
        .expect("prepare");
    let raw_key = PostgresLockKeys::advisory_key(&format!("peers/raw/{pid}"));

    let mut samples: [Vec<Duration>; 4] = Default::default();
    let mut order = [0usize, 1, 2, 3];
    let mut random = Shuffle::seeded();
    for round in 0..WARM_UP + pairs {
        // A fresh order every round, so no variant systematically follows another.
        random.shuffle(&mut order);
        for variant in order {
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
                    let connection = pool.acquire().await.expect("sqlx checkout");
                    match pooled_lock
                        .try_acquire(connection)
                        .await
                        .expect("sqlx lock")
                    {
                        Either::Left(guard) => {
                            guard.release_now().await.expect("sqlx release");
                        }
                        Either::Right(_) => panic!("the sqlx pooled lock was busy"),
                    }
                }
                2 => match dedicated_lock
                    .try_acquire(&mut dedicated)
                    .await
                    .expect("sqlx lock")
                {
                    Either::Left(guard) => {
                        guard.release_now().await.expect("sqlx release");
                    }
                    Either::Right(_) => panic!("the sqlx dedicated lock was busy"),
                },
                _ => {
                    let taken: bool = raw
                        .query_one(&try_lock, &[&raw_key])
                        .await
                        .expect("raw lock")
                        .get(0);
                    assert!(taken);
                    let released: bool = raw
                        .query_one(&unlock, &[&raw_key])
                        .await
                        .expect("raw unlock")
                        .get(0);
                    assert!(released);
                }
            }
            if round >= WARM_UP {
                samples[variant].push(started.elapsed());
            }
        }
    }
    let [kit, sqlx_pool, sqlx_dedicated, raw] = samples.map(median);
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!("PostgreSQL try-lock + release, {pairs} interleaved pairs each, medians:");
    println!(
        "  lockingkit try_acquire+release (default options)   {:>8.1} µs",
        us(kit)
    );
    println!(
        "  sqlx PgAdvisoryLock, PgPool of 4 (checkout timed)  {:>8.1} µs",
        us(sqlx_pool)
    );
    println!(
        "  sqlx PgAdvisoryLock, one dedicated connection      {:>8.1} µs",
        us(sqlx_dedicated)
    );
    println!(
        "  raw prepared tokio-postgres pair                   {:>8.1} µs",
        us(raw)
    );
    println!(
        "  ratio lockingkit / sqlx pooled                     {:>8.3} (goal <= 1.00)",
        us(kit) / us(sqlx_pool)
    );
    println!(
        "{{\"pairs\":{pairs},\"lockingkit_us\":{:.1},\"sqlx_pool_us\":{:.1},\"sqlx_dedicated_us\":{:.1},\"raw_us\":{:.1},\"ratio_to_sqlx_pool\":{:.3}}}",
        us(kit),
        us(sqlx_pool),
        us(sqlx_dedicated),
        us(raw),
        us(kit) / us(sqlx_pool)
    );
}
