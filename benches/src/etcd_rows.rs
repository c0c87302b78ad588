//! The etcd rows of the benchmark: an acquire+release pair next to the same transactions sent
//! raw through etcd-client, the cross-process hand-off on three members, and throughput of 256
//! tasks on distinct keys on three members, with the connections it used to all of them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use lockingkit::keys::EtcdLockKeys;
use lockingkit::{DistributedLock, EtcdBackend};
use lockingkit_tests::etcd::EtcdCluster;

use crate::handoff::cross_process_handoff;
use crate::load::pairs_for;
use crate::pair::{lock_on, lock_pair};
use crate::samples::{interleaved, timed, Order, Percentiles, Rounds};
use crate::table::{ms, pass};

/// Sample counts for the etcd rows.
#[derive(Clone, Copy)]
pub struct EtcdSizes {
    /// Pairs of each side on one member.
    pub pairs: usize,
    /// Hand-offs on three members.
    pub handoffs: usize,
    /// How long each side of the throughput row runs.
    pub load: Duration,
}

/// What the etcd rows measured.
pub struct EtcdReport {
    /// LockingKit's median pair on one member.
    pub pair: Duration,
    /// The same transactions' median pair, sent raw.
    pub raw_pair: Duration,
    /// Cross-process hand-offs on three members.
    pub handoff: Percentiles,
    /// LockingKit's pairs per second, 256 tasks on three members.
    pub kit_per_s: f64,
    /// The raw client's pairs per second, the same way.
    pub raw_per_s: f64,
    /// The TCP connections LockingKit had open to the three members meanwhile.
    pub connections: usize,
}

impl EtcdReport {
    /// LockingKit's median pair over the raw one's (the goal is at most 1.10).
    pub fn pair_ratio(&self) -> f64 {
        self.pair.as_secs_f64() / self.raw_pair.as_secs_f64().max(1e-9)
    }

    /// The etcd rows, in the table's columns.
    pub fn render(&self) -> String {
        format!(
            "| etcd try_acquire+release vs the same transactions raw through etcd-client, median (1 member) | {:.3} ms | {:.3} ms | ratio ≤ 1.10 | {:.2} {} |\n\
             | cross-process hand-off p50 / p99, etcd, three members, woken by the watch | {:.2} / {:.2} ms | | p50 ≤ 5 ms | {} |\n\
             | etcd pairs/s, 256 tasks on distinct keys, three members (TCP connections to all members) | {:.0}/s ({}) | {:.0}/s (raw, one client) | | |",
            ms(self.pair),
            ms(self.raw_pair),
            self.pair_ratio(),
            pass(self.pair_ratio() <= 1.10),
            ms(self.handoff.p50),
            ms(self.handoff.p99),
            pass(self.handoff.p50 <= Duration::from_millis(5)),
            self.kit_per_s,
            self.connections,
            self.raw_per_s,
        )
    }
}

fn lock(cluster: &EtcdCluster) -> DistributedLock {
    let options = cluster.options(Duration::from_secs(30));
    lock_on(EtcdBackend::new(options).expect("options"))
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

/// Median pair latencies, LockingKit and raw, alternating (LockingKit first) over `pairs`
/// rounded up to tens.
pub async fn pairs(cluster: &EtcdCluster, pairs: usize) -> (Duration, Duration) {
    let locks = lock(cluster);
    let client = cluster.client().await;
    let lease = raw_lease(&client).await;
    let n = AtomicU64::new(0);
    let rounds = Rounds::new(pairs.next_multiple_of(10), 0, Order::Fixed);
    let samples = interleaved(rounds, |variant| {
        let (locks, client, n) = (&locks, &client, &n);
        async move {
            match variant {
                0 => timed(lock_pair(locks, "bench/etcd/pair")).await,
                _ => {
                    let n = n.fetch_add(1, Ordering::Relaxed) + 1;
                    timed(raw_pair(client, lease, "bench/etcd/pair", n)).await
                }
            }
        }
    })
    .await;
    let [kit, raw] = samples.map(|samples| Percentiles::of(samples).p50);
    (kit, raw)
}

/// A 30 s lease of the raw client's, which its pairs' entries are put under.
async fn raw_lease(client: &Client) -> i64 {
    client
        .lease_client()
        .grant(30, None)
        .await
        .expect("grant")
        .id()
}

/// Pairs per second of 256 tasks on distinct keys, LockingKit then raw, and the TCP
/// connections LockingKit's backend had open to the cluster's members, all of them counted.
async fn throughput(cluster: &EtcdCluster, length: Duration) -> (f64, f64, usize) {
    let locks = lock(cluster);
    let kit_pair = move |task: usize, _round: u64| {
        let locks = locks.clone();
        async move { lock_pair(&locks, &format!("bench/etcd/throughput/{task}")).await }
    };
    let kit = pairs_for(256, length, kit_pair).await as f64 / length.as_secs_f64();
    // Only LockingKit's backend is connected now: the fixture's clients are gone.
    let connections = connections_to(cluster);
    let client = cluster.client().await;
    let lease = raw_lease(&client).await;
    let raw_pair = move |task: usize, round: u64| {
        let client = client.clone();
        async move {
            let key = format!("bench/etcd/raw-throughput/{task}");
            raw_pair(&client, lease, &key, round + 1).await;
        }
    };
    let raw = pairs_for(256, length, raw_pair).await as f64 / length.as_secs_f64();
    (kit, raw, connections)
}

/// Established TCP connections of this process to the cluster's client ports.
fn connections_to(cluster: &EtcdCluster) -> usize {
    let ports: Vec<u16> = cluster
        .endpoints()
        .iter()
        .filter_map(|e| e.rsplit(':').next()?.parse().ok())
        .collect();
    crate::load::connections_to(&ports)
}
