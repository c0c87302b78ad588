//! Leader election across processes on PostgreSQL: run two (or more) of these, one runs the
//! job, kill it (Ctrl-C resigns; `kill -9` does not), and another takes over.
//!
//! ```text
//! LOCKINGKIT_POSTGRES="host=127.0.0.1 port=5432 user=postgres dbname=postgres" \
//!     cargo run -p lockingkit-examples --features postgres --example leader
//! ```
//!
//! Without `LOCKINGKIT_POSTGRES` it runs on the in-memory provider, which only its own process
//! sees: a first look, one process only. With `LOCKINGKIT_POSTGRES` set but the example built
//! without `--features postgres` it refuses to start, since every process would then lead on
//! an in-memory provider of its own. LockingKit's own log lines (a lost lock, an outage) are
//! printed to stderr; `RUST_LOG` is not read, the level is `info`.
//!
//! Take-over bounds (see the README's "Leader election" section): after Ctrl-C the leader
//! resigns, and a follower leads within its `max_retry_delay` (1 s by default) plus one round
//! trip; after `kill -9` the server frees the dead session's lock as soon as the operating
//! system closes its socket, and the follower leads within the same bound after that.
//!
//! # A paused leader
//!
//! A leader stopped without dying (`kill -STOP`, a debugger, a frozen VM) still holds the lock:
//! its socket stays open, the operating system answers the server's keepalives, and PostgreSQL
//! keeps the session and its lock. No follower leads while it is stopped — nothing can tell a
//! paused process from a slow one. Once it is continued (`kill -CONT`) after more than twice
//! the provider's `check_interval` (10 s by default), its lock is past its loss deadline: it
//! stops reporting leading at once, its job ends, it gives the lock up and a follower leads.
//! The job below checks `term.is_held()` before each batch, so no batch starts in the moment
//! between the process waking up and the engine declaring the loss; a write already under way
//! is what the term number (a fencing token) is for. On a lease backend (Redis, etcd, Azure) a
//! follower leads once the paused leader's lease expires, and the paused one finds the same
//! deadline passed when it wakes.

use std::time::Duration;

use lockingkit::{DistributedLock, LeaderState};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::stderr)
        .init();
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{error}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let locks = provider()?;
    let pid = std::process::id();
    let leadership = locks
        .leader("jobs/nightly-export")?
        .start(move |term| async move {
            // The job: one batch a second, fenced by the term number.
            while term.is_held() {
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
    println!(
        "[{pid}] campaigning on {}; Ctrl-C resigns",
        locks.provider()
    );
    tokio::signal::ctrl_c().await?;
    leadership.resign().await?;
    locks.shutdown(Duration::from_secs(5)).await?;
    watch.abort();
    println!("[{pid}] resigned");
    Ok(())
}

/// PostgreSQL when `LOCKINGKIT_POSTGRES` is set, the in-memory provider otherwise.
fn provider() -> Result<DistributedLock, Box<dyn std::error::Error>> {
    match std::env::var("LOCKINGKIT_POSTGRES") {
        Ok(connection) => postgres(connection),
        Err(_) => {
            eprintln!(
                "LOCKINGKIT_POSTGRES is not set: campaigning on the in-memory provider, which \
                 no other process sees"
            );
            Ok(DistributedLock::in_memory())
        }
    }
}

#[cfg(feature = "postgres")]
fn postgres(connection: String) -> Result<DistributedLock, Box<dyn std::error::Error>> {
    let backend = lockingkit::PostgresBackend::new(lockingkit::PostgresOptions::new(connection))?;
    Ok(DistributedLock::builder(backend).build()?)
}

#[cfg(not(feature = "postgres"))]
fn postgres(_connection: String) -> Result<DistributedLock, Box<dyn std::error::Error>> {
    Err(
        "LOCKINGKIT_POSTGRES is set, but this example was built without the `postgres` \
         feature: run it with `--features postgres` (on the in-memory provider every process \
         would lead on its own)"
            .into(),
    )
}
