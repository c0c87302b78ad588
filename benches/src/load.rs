//! Load: many tasks repeating one piece of work for a set time, the throughput rows (7, 13, 16
//! and etcd's) that alternate LockingKit's pairs with a baseline's under it, and the connections
//! a side used.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long the warm-up of a load row runs each side: sessions open, statements prepared,
/// the fencing sequence created.
pub const WARM_UP: Duration = Duration::from_millis(200);

/// What the tasks of [`tasks_for`] ask before each repetition.
#[derive(Clone, Debug)]
pub struct Running(Arc<AtomicBool>);

impl Running {
    /// Whether the time is not up yet: the task goes on while this holds.
    pub fn goes_on(&self) -> bool {
        !self.0.load(Ordering::Relaxed)
    }
}

/// Runs `tasks` tasks, the one of index `i` being `task(i, running)`, for `length`, then tells
/// them to stop (`running` stops going on); answers the sum of what they answer, each task
/// answering how often it did its work.
pub async fn tasks_for<Task>(
    tasks: usize,
    length: Duration,
    task: impl Fn(usize, Running) -> Task,
) -> u64
where
    Task: Future<Output = u64> + Send + 'static,
{
    let stop = Arc::new(AtomicBool::new(false));
    let mut running = tokio::task::JoinSet::new();
    for index in 0..tasks {
        running.spawn(task(index, Running(stop.clone())));
    }
    tokio::time::sleep(length).await;
    stop.store(true, Ordering::Relaxed);
    let mut done = 0;
    while let Some(result) = running.join_next().await {
        done += result.expect("a load task panicked");
    }
    done
}

/// Runs `tasks` tasks doing pairs through `pair(task, round)` for `length`; returns the pairs
/// done.
pub async fn pairs_for<F, Fut>(tasks: usize, length: Duration, pair: F) -> u64
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    tasks_for(tasks, length, |task, running| {
        let pair = pair.clone();
        async move {
            let mut round = 0;
            while running.goes_on() {
                pair(task, round).await;
                round += 1;
            }
            round
        }
    })
    .await
}

/// Pairs per second on many keys at once, and the connections each side used.
#[derive(Clone, Copy, Debug, Default)]
pub struct Throughput {
    /// LockingKit's pairs per second.
    pub lockingkit_pairs_per_s: f64,
    /// The connections LockingKit used for them.
    pub lockingkit_connections: usize,
    /// The baseline's pairs per second.
    pub raw_pairs_per_s: f64,
    /// The connections of the baseline's pool.
    pub raw_connections: usize,
}

impl Throughput {
    /// LockingKit's pairs per second over the baseline's (the goal is at least 1.0).
    pub fn ratio(&self) -> f64 {
        self.lockingkit_pairs_per_s / self.raw_pairs_per_s
    }
}

/// `rounds` rounds of LockingKit's pairs (`kit`) then the baseline's (`raw`), `length` each,
/// `tasks` at once: the pairs per second of each side.
pub async fn alternating<Kit, KitPair, Raw, RawPair>(
    tasks: usize,
    rounds: usize,
    length: Duration,
    kit: Kit,
    raw: Raw,
) -> (f64, f64)
where
    Kit: Fn(usize, u64) -> KitPair + Clone + Send + 'static,
    KitPair: Future<Output = ()> + Send,
    Raw: Fn(usize, u64) -> RawPair + Clone + Send + 'static,
    RawPair: Future<Output = ()> + Send,
{
    let (mut kit_done, mut raw_done) = (0, 0);
    for _ in 0..rounds {
        kit_done += pairs_for(tasks, length, kit.clone()).await;
        raw_done += pairs_for(tasks, length, raw.clone()).await;
    }
    let seconds = length.as_secs_f64() * rounds as f64;
    (kit_done as f64 / seconds, raw_done as f64 / seconds)
}

/// Established TCP connections of this process to any of `ports` on this machine (sockets of
/// `/proc/self/fd` found in `/proc/net/tcp`): the connections a side of a load row used.
pub fn connections_to(ports: &[u16]) -> usize {
    let own: std::collections::HashSet<String> = std::fs::read_dir("/proc/self/fd")
        .map(|dir| {
            dir.flatten()
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .filter_map(|link| {
                    let link = link.to_string_lossy().into_owned();
                    Some(link.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
                })
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let remote = fields.get(2).and_then(|a| a.split(':').nth(1));
            let port = remote.and_then(|p| u16::from_str_radix(p, 16).ok());
            fields.get(3) == Some(&"01")
                && port.is_some_and(|p| ports.contains(&p))
                && fields.get(9).is_some_and(|inode| own.contains(*inode))
        })
        .count()
}
