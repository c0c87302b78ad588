//! Benchmark rows of the patterns (`cargo bench -p lockingkit-benches --bench lockingkit --
//! patterns`): a multi-key hold of two keys against two single holds in sequence, and election
//! failover time.

use std::time::Duration;

use lockingkit::{DistributedLock, LeaderState, Leadership};
use tokio::time::Instant;

use crate::pair::lock_pair;
use crate::samples::Percentiles;

/// `samples` interleaved rounds on `locks`: (one `try_acquire_all` of two keys + release, two
/// `try_acquire` + release pairs in sequence), each round timed.
pub async fn multi_key_pair(locks: &DistributedLock, samples: usize) -> (Percentiles, Percentiles) {
    let (mut multi, mut singles) = (Vec::new(), Vec::new());
    let keys = ["bench/multi/a", "bench/multi/b"];
    for _ in 0..samples {
        let started = Instant::now();
        let hold = locks.try_acquire_all(&keys).await.expect("free");
        hold.release().await.expect("released");
        multi.push(started.elapsed());
        let started = Instant::now();
        for key in keys {
            lock_pair(locks, key).await;
        }
        singles.push(started.elapsed());
    }
    (Percentiles::of(multi), Percentiles::of(singles))
}

fn campaign(locks: &DistributedLock, key: &str) -> Leadership {
    locks
        .leader(key)
        .expect("key")
        .start(|_| std::future::pending::<()>())
        .expect("started")
}

/// Failover time over `samples` runs: the leader on a provider made by `first` resigns; the
/// time until the campaign on `second` (another provider, as another process) leads.
pub async fn failover(
    first: impl Fn() -> DistributedLock,
    second: &DistributedLock,
    samples: usize,
) -> Percentiles {
    let mut times = Vec::new();
    for round in 0..samples {
        let key = format!("bench/leader/{round}");
        let leader = campaign(&first(), &key);
        let mut state = leader.state();
        let _ = state.wait_for(LeaderState::is_leading).await;
        let follower = campaign(second, &key);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let started = Instant::now();
        leader.resign().await.expect("resigned");
        let mut next = follower.state();
        let _ = next.wait_for(LeaderState::is_leading).await;
        times.push(started.elapsed());
        follower.resign().await.expect("resigned");
    }
    Percentiles::of(times)
}
