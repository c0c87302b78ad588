//! Locks that live inside your own transaction, on a deadpool-postgres pool: two workers ship
//! the same order at once, each taking the order's lock in the transaction that does the work.
//! The second waits until the first commits (which releases the lock), then sees the order
//! already shipped and rolls back.
//!
//! ```text
//! LOCKINGKIT_POSTGRES_URL=postgres://user:pass@127.0.0.1:5432/app \
//!   cargo run -p lockingkit-examples --features postgres --example postgres_transaction
//! ```
//!
//! It creates the fencing sequence (as a `PostgresBackend` would on first use) and a small
//! table, `lockingkit_example_orders`, if they are missing. Nothing of LockingKit's runs while
//! a lock is held: no session of its own, no renewal, no unlock. This works through PgBouncer
//! in transaction pooling mode too.

use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use lockingkit::providers::postgres::PostgresTransactionLocks;

type BoxError = Box<dyn Error + Send + Sync>;

const ORDER: i64 = 42;

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // tokio-postgres displays a server's error as just "db error": print the causes.
            let mut cause: Option<&(dyn Error + 'static)> = Some(error.as_ref());
            eprint!("error");
            while let Some(error) = cause {
                eprint!(": {error}");
                cause = error.source();
            }
            eprintln!();
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), BoxError> {
    let url = std::env::var("LOCKINGKIT_POSTGRES_URL")
        .map_err(|_| "set LOCKINGKIT_POSTGRES_URL to a PostgreSQL connection string")?;
    let config: tokio_postgres::Config = url.parse()?;
    let manager = Manager::from_config(
        config,
        tokio_postgres::NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    let pool = Pool::builder(manager).max_size(4).build()?;
    // One value for the whole process: it holds the statements, not a connection.
    let locks = PostgresTransactionLocks::default();

    let client = pool.get().await?;
    locks.create_fencing_sequence(&client).await?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS lockingkit_example_orders \
               (id bigint PRIMARY KEY, shipped_by text, fence bigint NOT NULL DEFAULT 0);
             INSERT INTO lockingkit_example_orders (id) VALUES (42) ON CONFLICT (id) DO NOTHING;
             UPDATE lockingkit_example_orders SET shipped_by = NULL WHERE id = 42;",
        )
        .await?;
    drop(client);

    let workers = ["worker-a", "worker-b"].map(|worker| {
        let (pool, locks) = (pool.clone(), locks.clone());
        tokio::spawn(async move { ship(&pool, &locks, worker).await })
    });
    for worker in workers {
        worker.await??;
    }
    Ok(())
}

/// Ships the order inside one transaction that holds the order's lock from the moment it is
/// taken until COMMIT.
async fn ship(pool: &Pool, locks: &PostgresTransactionLocks, worker: &str) -> Result<(), BoxError> {
    let mut client = pool.get().await?;
    let transaction = client.transaction().await?;
    // A deadpool-postgres Transaction passes as it is; waits up to 10 s for the other worker.
    let lock = locks
        .acquire(&transaction, "orders/42", Duration::from_secs(10))
        .await?;
    println!(
        "{worker}: holds orders/42 in its transaction (fencing token {})",
        lock.fencing_token()
    );
    let shipped_by: Option<String> = transaction
        .query_one(
            "SELECT shipped_by FROM lockingkit_example_orders WHERE id = $1",
            &[&ORDER],
        )
        .await?
        .get(0);
    if let Some(other) = shipped_by {
        println!("{worker}: order 42 was already shipped by {other}; rolling back");
        // Dropping the transaction rolls it back, which releases the lock as well.
        return Ok(());
    }
    tokio::time::sleep(Duration::from_millis(500)).await; // the shipping itself
    let fence = i64::try_from(lock.fencing_token())?;
    // The token guards the row against writers holding older locks (in either API): a row
    // that already carries a newer token is left alone, and so is this whole transaction.
    let updated = transaction
        .execute(
            "UPDATE lockingkit_example_orders SET shipped_by = $2, fence = $3 \
             WHERE id = $1 AND fence < $3",
            &[&ORDER, &worker, &fence],
        )
        .await?;
    if updated != 1 {
        println!("{worker}: order 42 carries a newer fencing token; rolling back");
        transaction.rollback().await?;
        return Ok(());
    }
    transaction.commit().await?;
    println!("{worker}: shipped order 42 and committed, which released the lock");
    Ok(())
}
