//! The etcd rows of the benchmark: an acquire+release pair next to the same transactions sent
//! raw through etcd-client, the cross-process hand-off on three members, and throughput of 256
//! tasks on distinct keys on three members, with the connections it used to all of them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use lockingkit::keys::EtcdLockKeys;
use lockingkit::{DistributedLock, EtcdBackend};
use tokio::time::Instant;

use crate::bench::{cross_process_handoff, Percentiles};
use crate::etcd::EtcdCluster;

/// Sample counts for the etcd rows.
#[derive(Clone, Copy)]
pub struct EtcdSizes {
    pub pairs: usize,
    pub handoffs: usize,
    pub load: Duration,
}

/// What the etcd rows measured.
pub struct EtcdReport {
    pub pair: Duration,
    pub raw_pair: Duration,
    pub handoff: Percentiles,
    pub kit_per_s: f64,
    pub raw_per_s: f64,
    pub connections: usize,
}

impl EtcdReport {
    pub fn pair_ratio(&self) -> f64 {
        self.pair.as_secs_f64() / self.raw_pair.as_secs_f64().max(1e-9)
    }

    pub fn render(&self) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        format!(
            "| etcd try_acquire+release vs the same transactions raw through etcd-client, median (1 member) | {:.3} ms | {:.3} ms | ratio ≤ 1.10 | {:.2} {} |\n\
             | cross-process hand-off p50 / p99, etcd, three members, woken by the watch | {:.2} / {:.2} ms | | p50 ≤ 5 ms | {} |\n\
             | etcd pairs/s, 256 tasks on distinct keys, three members (TCP connections to all members) | {:.0}/s ({}) | {:.0}/s (raw, one client) | | |",
            ms(self.pair),
            ms(self.raw_pair),
            self.pair_ratio(),
            if self.pair_ratio() <= 1.10 { "met" } else { "MISSED" },
            ms(self.handoff.p50),
            ms(self.handoff.p99),
            if self.handoff.p50 <= Duration::from_millis(5) { "met" } else { "MISSED" },
            self.kit_per_s,
            self.connections,
            self.raw_per_s,
        )
    }
}

fn lock(cluster: &EtcdCluster) -> DistributedLock {
    let options = cluster.options(Duration::from_secs(30));
    DistributedLock::builder(EtcdBackend::new(options).expect("options"))
        .build()
        .expect("lock")
}

/// Every row, each on clusters of its own.
pub async fn measure(sizes: EtcdSizes) -> EtcdReport {
    let single = EtcdCluster::single().await;
    let (pair, raw_pair) = pairs(&single, sizes.pairs).await;
    drop(single);
    let three = EtcdCluster::three().await;
    let (kit_per_s, raw_per_s, connections) = throughput(&three, sizes.load).await;
    let holder = lock(&three);
    let waiter = lock(&three);
    let handoff =
        cross_process_handoff(&holder, &waiter, "bench/etcd/handoff", sizes.handoffs).await;
    EtcdReport {
        pair,
        raw_pair,
        handoff,
        kit_per_s,
        raw_per_s,
        connections,
    }
}

/// The raw pair: LockingKit's transactions for an uncontended writer, by hand on one lease —
/// create if the directory is empty (else read the key), then delete compared on the key's
/// create revision.
async fn raw_pair(client: &Client, lease: i64, key: &str, n: u64) {
    let directory = EtcdLockKeys::lock_directory("raw/", key);
    let entry = format!("{directory}w/{lease:016x}-{n:x}");
    let empty = Compare::create_revision(directory.clone(), CompareOp::Equal, 0).with_prefix();
    let put = TxnOp::put(
        entry.clone(),
        Vec::new(),
        Some(PutOptions::new().with_lease(lease)),
    );
    let own = TxnOp::get(entry.clone(), Some(GetOptions::new().with_keys_only()));
    let mut kv = client.kv_client();
    let answer = kv
        .txn(Txn::new().when([empty]).and_then([put]).or_else([own]))
        .await
        .expect("txn");
    assert!(answer.succeeded(), "a key of its own is free");
    let created = answer.header().map(|h| h.revision()).expect("a revision");
    let release = Txn::new()
        .when([Compare::create_revision(
            entry.clone(),
            CompareOp::Equal,
            created,
        )])
        .and_then([TxnOp::delete(entry, None)]);
    let deleted = kv.txn(release).await.expect("delete");
    assert!(deleted.succeeded());
}

/// Median pair latencies, LockingKit and raw, interleaved in blocks of ten.
async fn pairs(cluster: &EtcdCluster, pairs: usize) -> (Duration, Duration) {
    let locks = lock(cluster);
    let client = cluster.client().await;
    let lease = client
        .lease_client()
        .grant(30, None)
        .await
        .expect("grant")
        .id();
    let (mut kit, mut raw) = (Vec::new(), Vec::new());
    let mut n = 0;
    for block in 0..pairs.div_ceil(10) {
        for _ in 0..10 {
            n += 1;
            let started = Instant::now();
            let held = locks.try_acquire("bench/etcd/pair").await.expect("free");
            held.release().await.expect("release");
            kit.push(started.elapsed());
            let started = Instant::now();
            raw_pair(&client, lease, "bench/etcd/pair", n).await;
            raw.push(started.elapsed());
        }
        let _ = block;
    }
    (median(kit), median(raw))
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

/// Pairs per second of 256 tasks on distinct keys, LockingKit then raw, and the TCP
/// connections LockingKit's backend had open to the cluster's members, all of them counted.
async fn throughput(cluster: &EtcdCluster, length: Duration) -> (f64, f64, usize) {
    let locks = lock(cluster);
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + length;
    let mut tasks = Vec::new();
    for task in 0..256 {
        let (locks, done) = (locks.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let key = format!("bench/etcd/throughput/{task}");
            while Instant::now() < until {
                let held = locks
                    .try_acquire(&key)
                    .await
                    .expect("a key of its own is free");
                held.release().await.expect("release");
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    let kit = done.load(Ordering::Relaxed) as f64 / length.as_secs_f64();
    // Only LockingKit's backend is connected now: the fixture's clients are gone.
    let connections = connections_to(cluster);
    let client = cluster.client().await;
    let lease = client
        .lease_client()
        .grant(30, None)
        .await
        .expect("grant")
        .id();
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + length;
    let mut tasks = Vec::new();
    for task in 0..256 {
        let (client, done) = (client.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let key = format!("bench/etcd/raw-throughput/{task}");
            let mut n = 0;
            while Instant::now() < until {
                n += 1;
                raw_pair(&client, lease, &key, n).await;
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for task in tasks {
        task.await.expect("task");
    }
    (
        kit,
        done.load(Ordering::Relaxed) as f64 / length.as_secs_f64(),
        connections,
    )
}

/// Established TCP connections of this process to the cluster's client ports (sockets of
/// `/proc/self/fd` found in `/proc/net/tcp`).
fn connections_to(cluster: &EtcdCluster) -> usize {
    let ports: Vec<u16> = cluster
        .endpoints()
        .iter()
        .filter_map(|e| e.rsplit(':').next()?.parse().ok())
        .collect();
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
