//! Leader election across processes on PostgreSQL: run two (or more) of these, one runs the
//! job, kill it (Ctrl-C resigns; `kill -9` does not), and another takes over.
//!
//! ```text
//! LOCKINGKIT_POSTGRES="host=127.0.0.1 port=5432 user=postgres dbname=postgres" \
//!     cargo run -p lockingkit-examples --features postgres --example leader
//! ```
//!
//! Without `LOCKINGKIT_POSTGRES` it runs on the in-memory provider (one process only).
//!
//! Take-over bounds (see the README's "Leader election" section): after Ctrl-C the leader
//! resigns, and a follower leads within its `max_retry_delay` (1 s by default) plus one round
//! trip; after `kill -9` the server frees the dead session's lock as soon as the operating
//! system closes its socket, and the follower leads within the same bound after that.

use std::time::Duration;

use lockingkit::{DistributedLock, LeaderState};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let locks = provider()?;
    let pid = std::process::id();
    let leadership = locks
        .leader("jobs/nightly-export")?
        .start(move |term| async move {
            // The job: one batch a second, fenced by the term number.
            loop {
                println!(
                    "[{pid}] leading in term {}: exporting a batch",
                    term.number()
                );
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })?;
    let mut state = leadership.state();
    let watch = tokio::spawn(async move {
        while state.changed().await.is_ok() {
            match &*state.borrow() {
                LeaderState::Leading { term, .. } => println!("[{pid}] elected, term {term}"),
                LeaderState::Campaigning => println!("[{pid}] following"),
                LeaderState::Stopped { error } => println!("[{pid}] stopped: {error:?}"),
                _ => {}
            }
        }
    });
    println!("[{pid}] campaigning; Ctrl-C resigns");
    tokio::signal::ctrl_c().await?;
    leadership.resign().await?;
    locks.shutdown(Duration::from_secs(5)).await?;
    watch.abort();
    println!("[{pid}] resigned");
    Ok(())
}

#[cfg(feature = "postgres")]
fn provider() -> Result<DistributedLock, lockingkit::LockError> {
    match std::env::var("LOCKINGKIT_POSTGRES") {
        Ok(connection) => DistributedLock::builder(lockingkit::PostgresBackend::new(
            lockingkit::PostgresOptions::new(connection),
        )?)
        .build(),
        Err(_) => Ok(DistributedLock::in_memory()),
    }
}

#[cfg(not(feature = "postgres"))]
fn provider() -> Result<DistributedLock, lockingkit::LockError> {
    Ok(DistributedLock::in_memory())
}
