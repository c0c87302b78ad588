//! The etcd provider against real clusters: the contract suite on one member and on three,
//! first come first served across processes, queue places that leave nothing behind, the key
//! layout as plain etcd clients see it, and configuration.
//!
//! Each test starts its own throwaway cluster (see `lockingkit_tests::etcd`).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lockingkit::providers::etcd::EtcdLockKeys;
use lockingkit::testing::{quick_polling, unique_prefix, ContractBackend};
use lockingkit::{DistributedLock, ErrorKind, EtcdBackend, EtcdOptions, LockOptions};
use lockingkit_tests::etcd::EtcdCluster;
use tokio::time::Instant;

/// The lease of every case whose subject is not the lease itself: long enough that a loaded
/// machine never misses a renewal (the fixture's requests may take 2 s, a third of it).
const TTL: Duration = Duration::from_secs(6);

fn lock_on(options: EtcdOptions, lock_options: LockOptions) -> DistributedLock {
    let backend = EtcdBackend::new(options).expect("valid etcd options");
    DistributedLock::builder(backend)
        .options(lock_options)
        .build()
        .expect("valid lock options")
}

fn process(cluster: &EtcdCluster) -> DistributedLock {
    lock_on(cluster.options(TTL), quick_polling())
}

fn backend(lock: &DistributedLock) -> &EtcdBackend {
    lock.backend::<EtcdBackend>().expect("an etcd-backed lock")
}

/// Waits for `condition`, polling: for state only the cluster can report.
async fn eventually(what: &str, within: Duration, mut condition: impl AsyncFnMut() -> bool) {
    let give_up = Instant::now() + within;
    while !condition().await {
        assert!(
            Instant::now() < give_up,
            "{what} did not happen within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Each "process" is a `DistributedLock` with its own etcd client, lease and watch stream.
struct EtcdContract {
    cluster: EtcdCluster,
}

impl ContractBackend for EtcdContract {
    async fn new_process(&self, options: LockOptions) -> DistributedLock {
        lock_on(self.cluster.options(TTL), options)
    }

    fn lease_period(&self) -> Duration {
        TTL
    }
}

impl Drop for EtcdContract {
    /// Nothing a contract case sends may make a member log an error.
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.cluster.assert_no_errors_logged();
        }
    }
}

mod single_member {
    use super::*;

    lockingkit::contract_tests!(async {
        EtcdContract {
            cluster: EtcdCluster::single().await,
        }
    });
}

mod three_members {
    use super::*;

    lockingkit::contract_tests!(async {
        EtcdContract {
            cluster: EtcdCluster::three().await,
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_lease_is_released_exactly_once() {
    let cluster = EtcdCluster::single().await;
    let options = cluster.options(TTL);
    lockingkit::testing::each_lease_is_released_exactly_once(
        || EtcdBackend::new(options.clone()).expect("options"),
        TTL,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_or_late_release_never_frees_the_next_holder() {
    let cluster = EtcdCluster::single().await;
    let options = cluster.options(TTL);
    lockingkit::testing::a_repeated_or_late_release_never_frees_the_next_holder(|| {
        EtcdBackend::new(options.clone()).expect("options")
    })
    .await;
}

/// Ten processes queue for one key, one after another, and get it in the order they arrived:
/// each stands in line with a key of its own whose create revision is its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_processes_get_the_key_in_arrival_order() {
    let cluster = EtcdCluster::single().await;
    // Slow polling, so that only the watch and the queue decide who goes next.
    let polling = LockOptions {
        min_retry_delay: Duration::from_millis(500),
        max_retry_delay: Duration::from_secs(1),
        ..LockOptions::default()
    };
    let holder = lock_on(cluster.options(TTL), polling.clone());
    let key = unique_prefix("fifo");
    let held = holder.try_acquire(&key).await.expect("the first holder");
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for arrival in 0..10 {
        let process = lock_on(cluster.options(TTL), polling.clone());
        let (key, order) = (key.clone(), order.clone());
        let waiter = process.clone();
        waiters.push(tokio::spawn(async move {
            let handle = waiter
                .acquire(&key, Duration::from_secs(60))
                .await
                .expect("a queued waiter gets the key");
            order
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(arrival);
            tokio::time::sleep(Duration::from_millis(20)).await;
            handle.release().await.expect("release");
        }));
        // The next process arrives only once this one stands in line.
        eventually(
            "the waiter's queue place",
            Duration::from_secs(10),
            async || backend(&process).queue_places() == 1,
        )
        .await;
    }
    let directory =
        EtcdLockKeys::lock_directory(lockingkit::providers::etcd::DEFAULT_KEY_PREFIX, &key);
    assert_eq!(
        cluster.count(&directory).await,
        11,
        "the holder and ten places"
    );
    let released = Instant::now();
    held.release().await.expect("release");
    for waiter in waiters {
        waiter.await.expect("waiter");
    }
    let served = order.lock().unwrap_or_else(PoisonError::into_inner).clone();
    assert_eq!(
        served,
        (0..10).collect::<Vec<_>>(),
        "served out of arrival order"
    );
    // Ten hand-offs woken by the watch, not by the one-second polling.
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "hand-offs took {:?}",
        released.elapsed()
    );
    assert_eq!(cluster.count(&directory).await, 0, "keys left behind");
}

/// Waits that time out or are dropped delete their queue places: nothing is left in etcd, and
/// the next waiter in line is not held up by them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_and_timed_out_waits_leave_no_queue_place_behind() {
    let cluster = EtcdCluster::single().await;
    let holder = process(&cluster);
    let key = unique_prefix("dropped-waits");
    let directory =
        EtcdLockKeys::lock_directory(lockingkit::providers::etcd::DEFAULT_KEY_PREFIX, &key);
    let held = holder.try_acquire(&key).await.expect("holder");
    let mut processes = Vec::new();
    let mut dropped = Vec::new();
    for index in 0..6 {
        let lock = process(&cluster);
        let waiter = lock.clone();
        let key = key.clone();
        if index % 2 == 0 {
            // Times out by itself.
            dropped.push(tokio::spawn(async move {
                let result = waiter.acquire(&key, Duration::from_millis(800)).await;
                assert_eq!(result.err().map(|e| e.kind()), Some(ErrorKind::Timeout));
            }));
        } else {
            // Dropped by its caller once it stands in line.
            let task = tokio::spawn(async move {
                let _ = waiter.acquire(&key, Duration::from_secs(60)).await;
            });
            eventually("a queue place", Duration::from_secs(10), async || {
                backend(&lock).queue_places() == 1
            })
            .await;
            task.abort();
        }
        processes.push(lock);
    }
    for task in dropped {
        task.await.expect("timed-out waiter");
    }
    eventually(
        "every queue place deleted",
        // Well before the waiters' leases could expire (a TTL after their last attempt): the
        // places are deleted, not left to expire.
        TTL / 2,
        async || cluster.count(&directory).await == 1,
    )
    .await;
    for lock in &processes {
        assert_eq!(backend(lock).queue_places(), 0);
        assert_eq!(backend(lock).pending_deletes(), 0);
    }
    // A newcomer is next: no abandoned place stands before it.
    let next = process(&cluster);
    let waiting = {
        let (next, key) = (next.clone(), key.clone());
        tokio::spawn(async move { next.acquire(&key, Duration::from_secs(30)).await })
    };
    eventually(
        "the newcomer's place",
        Duration::from_secs(10),
        async || backend(&next).queue_places() == 1,
    )
    .await;
    held.release().await.expect("release");
    let handle = tokio::time::timeout(Duration::from_secs(2), waiting)
        .await
        .expect("the newcomer is next once the holder leaves")
        .expect("task")
        .expect("acquired");
    handle.release().await.expect("release");
    eventually("the directory empty", Duration::from_secs(5), async || {
        cluster.count(&directory).await == 0
    })
    .await;
}

/// The holder's key is where the documented mapping says, attached to the backend's lease, and
/// its create revision is the fencing token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_clients_see_the_holders_key_on_the_backends_lease() {
    let cluster = EtcdCluster::single().await;
    let locks = process(&cluster);
    let key = "orders/42~ключ";
    let held = locks.try_acquire(key).await.expect("lock");
    let directory = EtcdLockKeys::lock_directory("lockingkit/", key);
    assert_eq!(
        directory,
        "lockingkit/lock/orders~2F42~7E~D0~BA~D0~BB~D1~8E~D1~87/"
    );
    let mut client = cluster.client().await;
    let found = client
        .get(
            directory.clone(),
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("get");
    let [kv] = found.kvs() else {
        panic!(
            "expected exactly the holder's key, found {}",
            found.kvs().len()
        );
    };
    assert!(kv
        .key_str()
        .expect("utf-8")
        .starts_with(&format!("{directory}w/")));
    assert_eq!(kv.create_revision() as u64, held.fencing_token());
    assert_eq!(Some(kv.lease()), backend(&locks).lease_id());
    held.release().await.expect("release");
    assert_eq!(cluster.count(&directory).await, 0);
}

/// A hundred holds share one lease: renewing them all sends a handful of keep-alives, not a
/// hundred, and one watch stream serves every hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_holds_share_one_lease_and_one_watch_stream() {
    let cluster = EtcdCluster::single().await;
    let locks = process(&cluster);
    let prefix = unique_prefix("shared-lease");
    let mut holds = Vec::new();
    for i in 0..100 {
        holds.push(
            locks
                .try_acquire(&format!("{prefix}/{i}"))
                .await
                .expect("lock"),
        );
    }
    let lease = backend(&locks).lease_id().expect("a lease");
    let mut client = cluster.client().await;
    let alive = client
        .lease_time_to_live(
            lease,
            Some(etcd_client::LeaseTimeToLiveOptions::new().with_keys()),
        )
        .await
        .expect("lease info");
    assert_eq!(
        alive.keys().len(),
        100,
        "every hold is a key on the one lease"
    );
    let before = backend(&locks).keep_alives_sent();
    tokio::time::sleep(TTL * 2).await;
    // Six renewals per hold in two TTLs; at most one keep-alive per twentieth of the TTL.
    let sent = backend(&locks).keep_alives_sent() - before;
    assert!(sent <= 42, "{sent} keep-alives for 100 holds over two TTLs");
    assert!(
        holds.iter().all(|h| h.is_held()),
        "renewals kept every hold"
    );
    assert_eq!(
        backend(&locks).watches(),
        100,
        "one watch per hold on the one stream"
    );
    assert_eq!(client.leases().await.expect("leases").leases().len(), 1);
    for hold in holds {
        hold.release().await.expect("release");
    }
}
