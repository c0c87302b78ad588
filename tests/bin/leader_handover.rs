//! A leader-election instance for the hand-over test (tests/leader_handover.rs): it campaigns
//! for one key on PostgreSQL, leads `LEADER_HANDOVER_TERMS` short terms (work that returns
//! after `LEADER_HANDOVER_TERM_MS`, which hands the key to the other instance), and samples
//! whether it leads every 100 µs on a thread of its own, then resigns.
//!
//! `LEADER_HANDOVER_CONNECTION` is the connection string, `LEADER_HANDOVER_KEY` the key. For
//! each term it saw itself leading it prints `term <n> <first> <last>`: `first` is a wall-clock
//! instant (nanoseconds since the Unix epoch) taken just *after* the first sample that read
//! the term as leading, `last` one taken just *before* the last such sample. So the term
//! surely led at some instant at or before `first`, and at some instant at or after `last`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockingkit::{DistributedLock, LeaderState, PostgresBackend, PostgresOptions};
use tokio::sync::watch;

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos())
}

/// Samples `state` until `stop`; the first and last instants of each term. Every 100 µs, not
/// every millisecond: the two-leader window this looks for lasted well under a millisecond
/// (0.01–0.7 ms when the state flipped only after the release was answered), and a sample every
/// millisecond saw none of them in five runs.
fn sample(
    state: watch::Receiver<LeaderState>,
    stop: Arc<AtomicBool>,
) -> BTreeMap<u64, (u128, u128)> {
    let mut terms = BTreeMap::new();
    while !stop.load(Ordering::Acquire) {
        let before = now_ns();
        let term = state.borrow().term();
        let after = now_ns();
        if let Some(term) = term {
            let span = terms.entry(term).or_insert((after, before));
            span.1 = before;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    terms
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let connection = std::env::var("LEADER_HANDOVER_CONNECTION")?;
    let key = std::env::var("LEADER_HANDOVER_KEY")?;
    let terms: usize = std::env::var("LEADER_HANDOVER_TERMS")?.parse()?;
    let term_length = Duration::from_millis(std::env::var("LEADER_HANDOVER_TERM_MS")?.parse()?);
    let locks = DistributedLock::builder(PostgresBackend::new(PostgresOptions::new(connection))?)
        .build()?;
    locks.verify().await?;
    let (ended_tx, mut ended) = tokio::sync::mpsc::unbounded_channel();
    let leadership = locks
        .leader(&key)?
        // Pauses between terms of 15–60 ms: the other instance, queued at the server, is
        // granted the key the moment this one releases it and has time to take it up, and this
        // one queues again behind it.
        .retry_delays(Duration::from_millis(30), Duration::from_millis(60))
        .start(move |_term| {
            let ended_tx = ended_tx.clone();
            async move {
                tokio::time::sleep(term_length).await;
                let _ = ended_tx.send(());
            }
        })?;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (state, stop) = (leadership.state(), stop.clone());
        std::thread::spawn(move || sample(state, stop))
    };
    for _ in 0..terms {
        ended.recv().await.ok_or("the campaign ended early")?;
    }
    leadership.resign().await?;
    stop.store(true, Ordering::Release);
    let seen = sampler.join().map_err(|_| "the sampler panicked")?;
    for (term, (first, last)) in seen {
        println!("term {term} {first} {last}");
    }
    Ok(())
}
