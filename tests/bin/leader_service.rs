//! A leader-election instance for the failover test (tests/leader_failover.rs): it campaigns
//! for one key on PostgreSQL and runs leader work that never returns, until it is killed.
//!
//! `LEADER_SERVICE_CONNECTION` is the connection string, `LEADER_SERVICE_KEY` the key. It
//! prints `leading <term>` as each term's work starts.

use std::time::Duration;

use lockingkit::{DistributedLock, PostgresBackend, PostgresOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let connection = std::env::var("LEADER_SERVICE_CONNECTION")?;
    let key = std::env::var("LEADER_SERVICE_KEY")?;
    let locks = DistributedLock::builder(PostgresBackend::new(PostgresOptions::new(connection))?)
        .build()?;
    locks.verify().await?;
    let leadership = locks.leader(&key)?.start(|term| async move {
        println!("leading {}", term.number());
        loop {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
    })?;
    // Runs until killed; a campaign that stops on its own is a failure of this instance.
    let mut state = leadership.state();
    let stopped = state.wait_for(|s| s.is_stopped()).await?.clone();
    Err(format!("the campaign stopped: {stopped:?}").into())
}
