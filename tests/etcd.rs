//! The etcd provider against real clusters: the contract suite on one member and on three,
//! first come first served across processes, queue places that leave nothing behind, the key
//! layout as plain etcd clients see it, and configuration.
//!
//! Each test starts its own throwaway cluster (see `lockingkit_tests::etcd`).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lockingkit::keys::EtcdLockKeys;
use lockingkit::testing::{quick_polling, unique_prefix, ContractBackend};
use lockingkit::{DistributedLock, ErrorKind, EtcdBackend, EtcdOptions, LockOptions};
use lockingkit_tests::checks::release_once_won;
use lockingkit_tests::etcd::{add_user, Auth, EtcdCluster};
use lockingkit_tests::polling::eventually;
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
    let polling = LockOptions::default()
        .with_min_retry_delay(Duration::from_millis(500))
        .with_max_retry_delay(Duration::from_secs(1));
    let holder = lock_on(cluster.options(TTL), polling.clone());
    let key = unique_prefix("fifo");
    let held = holder.try_acquire(&key).await.expect("the first holder");
    let directory =
        EtcdLockKeys::lock_directory(lockingkit::providers::etcd::DEFAULT_KEY_PREFIX, &key);
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
        // The next process arrives only once this one stands in line: its place is written
        // (`queue_places` counts a place still being made too).
        eventually(
            "the waiter's queue place",
            Duration::from_secs(10),
            async || {
                backend(&process).queue_places() == 1
                    && cluster.count(&directory).await == arrival + 2
            },
        )
        .await;
    }
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

/// Every "process" of the contract is an engine on a clone of one backend: the engines share
/// the clients, the lease and the watch stream, and must still exclude each other exactly as
/// separate processes do.
struct ClonesContract {
    cluster: EtcdCluster,
    shared: EtcdBackend,
}

impl ContractBackend for ClonesContract {
    async fn new_process(&self, options: LockOptions) -> DistributedLock {
        DistributedLock::builder(self.shared.clone())
            .options(options)
            .build()
            .expect("valid lock options")
    }

    fn lease_period(&self) -> Duration {
        TTL
    }
}

impl Drop for ClonesContract {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.cluster.assert_no_errors_logged();
        }
    }
}

mod clones_of_one_backend {
    use super::*;

    lockingkit::contract_tests!(async {
        let cluster = EtcdCluster::single().await;
        let shared = EtcdBackend::new(cluster.options(TTL)).expect("valid etcd options");
        ClonesContract { cluster, shared }
    });
}

/// A waiter of one engine stands in line; when the holder leaves, engines on other clones of
/// the same backend try at once. The place is the waiter's alone: it gets the lock, the others
/// are told busy, and there is never more than one holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiters_place_is_never_taken_by_another_engine_on_the_same_backend() {
    let cluster = EtcdCluster::single().await;
    let shared = EtcdBackend::new(cluster.options(TTL)).expect("options");
    let engine = |backend: EtcdBackend| {
        DistributedLock::builder(backend)
            .options(quick_polling())
            .build()
            .expect("lock options")
    };
    let (waiter, b, c) = (
        engine(shared.clone()),
        engine(shared.clone()),
        engine(shared.clone()),
    );
    let holder = process(&cluster);
    for round in 0..5 {
        let key = unique_prefix(&format!("clones-{round}"));
        let held = holder.try_acquire(&key).await.expect("the holder");
        let waiting = {
            let (waiter, key) = (waiter.clone(), key.clone());
            tokio::spawn(async move { waiter.acquire(&key, Duration::from_secs(20)).await })
        };
        eventually("the waiter's place", Duration::from_secs(10), async || {
            shared.queue_places() == 1
        })
        .await;
        held.release().await.expect("release");
        let (from_b, from_c) = tokio::join!(b.try_acquire(&key), c.try_acquire(&key));
        let won = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the waiter is next")
            .expect("task")
            .expect("the waiter's lock");
        for other in [from_b, from_c] {
            assert_eq!(
                other.err().map(|e| e.kind()),
                Some(ErrorKind::Busy),
                "round {round}: another engine took the waiter's place"
            );
        }
        assert!(won.is_held());
        won.release().await.expect("release");
    }
}

/// A reader that queued before a writer goes before it (the writer queued later, so it waits
/// for the reader), and each is woken by the watch, not by its one-second polling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_queued_before_a_writer_is_served_first_and_woken_by_the_watch() {
    let cluster = EtcdCluster::single().await;
    let slow = LockOptions::default()
        .with_min_retry_delay(Duration::from_millis(900))
        .with_max_retry_delay(Duration::from_secs(1));
    let holder = process(&cluster);
    let readers = lock_on(cluster.options(TTL), slow.clone());
    let writers = lock_on(cluster.options(TTL), slow);
    for round in 0..3 {
        let key = unique_prefix(&format!("reader-first-{round}"));
        let held = holder.try_acquire(&key).await.expect("the first writer");
        let reader = {
            let rw = readers.reader_writer(&key).expect("rw");
            tokio::spawn(async move { rw.read(Duration::from_secs(20)).await })
        };
        eventually("the reader's place", Duration::from_secs(10), async || {
            backend(&readers).queue_places() == 1
        })
        .await;
        let writer = {
            let (writers, key) = (writers.clone(), key.clone());
            tokio::spawn(async move { writers.acquire(&key, Duration::from_secs(20)).await })
        };
        eventually("the writer's place", Duration::from_secs(10), async || {
            backend(&writers).queue_places() == 1
        })
        .await;
        let released = Instant::now();
        held.release().await.expect("release");
        let read = reader.await.expect("task").expect("the reader's lock");
        let handed = released.elapsed();
        assert!(
            handed < Duration::from_millis(600),
            "round {round}: the reader got in {handed:?} after the release, as if by polling"
        );
        assert!(
            !writer.is_finished(),
            "the later writer overtook the reader"
        );
        let released = Instant::now();
        read.release().await.expect("release");
        let written = writer.await.expect("task").expect("the writer's lock");
        let handed = released.elapsed();
        assert!(
            handed < Duration::from_millis(600),
            "round {round}: the writer got in {handed:?} after the reader left"
        );
        written.release().await.expect("release");
    }
}

/// A wait is the engine's, not the task's that happens to poll it: a reader's `acquire`
/// future moved to another task mid-wait keeps its place in line, and still goes before a
/// writer that queued after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
// The first task's result is the unfinished wait itself, which goes on in another task.
#[allow(clippy::async_yields_async)]
async fn a_wait_moved_to_another_task_keeps_its_place() {
    let slow = LockOptions::default()
        .with_min_retry_delay(Duration::from_millis(900))
        .with_max_retry_delay(Duration::from_secs(1));
    let cluster = EtcdCluster::single().await;
    let holder = process(&cluster);
    let readers = lock_on(cluster.options(TTL), slow.clone());
    let writers = lock_on(cluster.options(TTL), slow);
    let key = unique_prefix("moved-wait");
    let held = holder.try_acquire(&key).await.expect("the first writer");
    let rw = readers.reader_writer(&key).expect("rw");
    let mut read = Box::pin(async move { rw.read(Duration::from_secs(20)).await });
    // The wait starts in one task, which hands the unfinished future back once it has a place.
    let first_task = {
        let readers = readers.clone();
        tokio::spawn(async move {
            let placed = async {
                while backend(&readers).queue_places() != 1 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            tokio::select! {
                outcome = &mut read => panic!("the read ended while the key was held: {outcome:?}"),
                _ = tokio::time::timeout(Duration::from_secs(10), placed) => {}
            }
            read
        })
    };
    let read = first_task.await.expect("task");
    assert_eq!(backend(&readers).queue_places(), 1, "the reader's place");
    let reader = tokio::spawn(read);
    let writer = {
        let (writers, key) = (writers.clone(), key.clone());
        tokio::spawn(async move { writers.acquire(&key, Duration::from_secs(20)).await })
    };
    eventually("the writer's place", Duration::from_secs(10), async || {
        backend(&writers).queue_places() == 1
    })
    .await;
    // Longer than a wait without hints keeps its place: a place tied to the first task would
    // be gone by now, and the reader would queue again behind the writer.
    tokio::time::sleep(Duration::from_millis(300)).await;
    held.release().await.expect("release");
    let read = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .expect("the reader is next")
        .expect("task")
        .expect("the reader's lock");
    assert!(
        !writer.is_finished(),
        "the later writer overtook the reader whose wait moved"
    );
    read.release().await.expect("release");
    writer
        .await
        .expect("task")
        .expect("the writer's lock")
        .release()
        .await
        .expect("release");
}

/// Readers that queue together behind a writer hold together once it leaves, and a writer
/// that queued after them waits for all of them: neither side starves the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_queued_together_hold_together_before_a_later_writer() {
    let cluster = EtcdCluster::single().await;
    let holder = process(&cluster);
    let key = unique_prefix("readers-together");
    let held = holder.try_acquire(&key).await.expect("the first writer");
    let mut readers = Vec::new();
    for _ in 0..3 {
        let lock = process(&cluster);
        let rw = lock.reader_writer(&key).expect("rw");
        readers.push(tokio::spawn(async move {
            rw.read(Duration::from_secs(20)).await
        }));
        eventually("the reader's place", Duration::from_secs(10), async || {
            backend(&lock).queue_places() == 1
        })
        .await;
    }
    let later = process(&cluster);
    let writer = {
        let (later, key) = (later.clone(), key.clone());
        tokio::spawn(async move { later.acquire(&key, Duration::from_secs(20)).await })
    };
    eventually("the writer's place", Duration::from_secs(10), async || {
        backend(&later).queue_places() == 1
    })
    .await;
    held.release().await.expect("release");
    let mut reads = Vec::new();
    for reader in readers {
        reads.push(reader.await.expect("task").expect("a reader's lock"));
    }
    assert!(
        reads.iter().all(|r| r.is_held()),
        "the readers hold together"
    );
    assert!(
        !writer.is_finished(),
        "the writer waits for the readers ahead"
    );
    for read in reads {
        read.release().await.expect("release");
    }
    release_once_won(writer, "once the readers left").await;
}

/// A semaphore's waiters in other processes are not woken by the watch (the engine gives
/// semaphore waiters no hint): a freed slot goes to the next process by polling, within its
/// retry delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freed_semaphore_slot_reaches_another_process_by_polling() {
    let cluster = EtcdCluster::single().await;
    let polling = LockOptions::default()
        .with_min_retry_delay(Duration::from_millis(200))
        .with_max_retry_delay(Duration::from_millis(400));
    let name = unique_prefix("semaphore-poll");
    let holders = process(&cluster);
    let semaphore = holders.semaphore(&name, 2).expect("semaphore");
    let first = semaphore.try_acquire().await.expect("slot 1");
    let second = semaphore.try_acquire().await.expect("slot 2");
    let other = lock_on(cluster.options(TTL), polling);
    let waiting = {
        let semaphore = other.semaphore(&name, 2).expect("semaphore");
        tokio::spawn(async move { semaphore.acquire(Duration::from_secs(20)).await })
    };
    eventually(
        "the other process's first attempt",
        Duration::from_secs(5),
        async || backend(&other).lease_id().is_some(),
    )
    .await;
    assert!(!waiting.is_finished(), "the semaphore is full");
    let freed = Instant::now();
    let token = first.fencing_token();
    first.release().await.expect("release");
    let slot = waiting.await.expect("task").expect("the freed slot");
    assert!(
        freed.elapsed() < Duration::from_secs(2),
        "polled within its retry delay"
    );
    assert!(slot.fencing_token() > token);
    slot.release().await.expect("release");
    second.release().await.expect("release");
}

/// On a cluster whose tokens expire after two seconds, locks keep working long after the first
/// token expired: a request refused for its token is authenticated again and sent once more,
/// and renewals of a hold go on through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_auth_tokens_are_renewed_without_failing_a_request() {
    let cluster = EtcdCluster::start(1, Auth::Root { token_ttl_secs: 2 }).await;
    let locks = process(&cluster);
    locks.verify().await.expect("root may lock");
    let key = unique_prefix("auth");
    let first = locks.try_acquire(&key).await.expect("lock");
    let token = first.fencing_token();
    // Three tokens' lives; renewals every 2 s ride on tokens that expire under them.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(first.is_held(), "renewals failed on an expired token");
    first.release().await.expect("release on a fresh token");
    let again = locks.try_acquire(&key).await.expect("lock again");
    assert!(again.fencing_token() > token);
    again.release().await.expect("release");
    cluster.assert_no_errors_logged();
}

/// Wrong credentials are misconfiguration, found by `verify` at startup and by attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_misconfigured() {
    let cluster = EtcdCluster::start(
        1,
        Auth::Root {
            token_ttl_secs: 300,
        },
    )
    .await;
    let options = cluster.options(TTL).with_password("not the password");
    let locks = lock_on(options, quick_polling());
    let verified = locks.verify().await;
    assert_eq!(
        verified.err().map(|e| e.kind()),
        Some(ErrorKind::Misconfigured)
    );
    let attempt = locks.try_acquire(&unique_prefix("auth-wrong")).await;
    assert_eq!(
        attempt.err().map(|e| e.kind()),
        Some(ErrorKind::Misconfigured)
    );
}

/// Sixty-four engines on clones of one backend whose password is wrong try to lock for five
/// seconds: every caller is told `Misconfigured`, and etcd checks the wrong password at most
/// once per step of the member's backoff (100 ms doubling to 5 s: seven steps in five seconds),
/// counted in etcd's own log, not once per caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_costs_one_member_one_login_per_backoff_step_not_one_per_caller() {
    sixty_four_callers_with_a_wrong_password(1).await;
}

/// The same on three members: users are cluster state, so a refusal by one member is every
/// caller's answer until its next login, and the others are not asked instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_costs_a_cluster_one_login_per_backoff_step_not_one_per_member() {
    sixty_four_callers_with_a_wrong_password(3).await;
}

async fn sixty_four_callers_with_a_wrong_password(members: usize) {
    let cluster = EtcdCluster::start(
        members,
        Auth::Root {
            token_ttl_secs: 300,
        },
    )
    .await;
    let shared =
        EtcdBackend::new(cluster.options(TTL).with_password("not the password")).expect("options");
    let run_for = Duration::from_secs(5);
    let started = Instant::now();
    let mut callers = Vec::new();
    for i in 0..64 {
        let locks = DistributedLock::builder(shared.clone())
            .options(quick_polling())
            .build()
            .expect("valid lock options");
        let key = unique_prefix(&format!("wrong-password-{i}"));
        callers.push(tokio::spawn(async move {
            let mut kinds = Vec::new();
            while started.elapsed() < run_for {
                kinds.push(locks.try_acquire(&key).await.err().map(|e| e.kind()));
                // Pacing, not synchronisation: a refusal comes back at once.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            kinds
        }));
    }
    let mut answers = std::collections::BTreeMap::<String, usize>::new();
    for caller in callers {
        for kind in caller.await.expect("caller") {
            *answers.entry(format!("{kind:?}")).or_default() += 1;
        }
    }
    let logins = cluster.failed_logins();
    eprintln!("{members} members: {logins} failed logins in {run_for:?}; answers: {answers:?}");
    let misconfigured = answers
        .get(&format!("{:?}", Some(ErrorKind::Misconfigured)))
        .copied()
        .unwrap_or(0);
    assert!(misconfigured >= 64, "every caller was answered");
    assert_eq!(
        answers.values().sum::<usize>(),
        misconfigured,
        "every caller is told Misconfigured: {answers:?}"
    );
    assert!(
        (1..=10).contains(&logins),
        "{logins} failed logins in {run_for:?}: more than one per backoff step"
    );
}

/// A cluster with authentication on, and options that name no user: reported as what it is,
/// not as refused credentials.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_on_and_no_user_is_misconfigured_and_says_so() {
    let cluster = EtcdCluster::start(
        1,
        Auth::Root {
            token_ttl_secs: 300,
        },
    )
    .await;
    let mut options = cluster.options(TTL);
    options.user = None;
    options.password = None;
    let locks = lock_on(options, quick_polling());
    let error = locks
        .try_acquire(&unique_prefix("no-user"))
        .await
        .expect_err("anonymous requests are refused");
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    let message = error.to_string();
    eprintln!("{message}");
    assert!(
        message.contains("authentication") && message.contains("no user"),
        "{message}"
    );
}

/// A user whose role may not read under the provider's key prefix is refused by `verify`,
/// before any lock is attempted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_refuses_a_user_without_permission_under_the_prefix() {
    let cluster = EtcdCluster::start(
        1,
        Auth::Root {
            token_ttl_secs: 300,
        },
    )
    .await;
    let mut admin = cluster.client().await;
    admin.role_add("elsewhere").await.expect("role");
    admin
        .role_grant_permission(
            "elsewhere",
            etcd_client::Permission::read_write("other/").with_prefix(),
        )
        .await
        .expect("grant");
    add_user(&mut admin, "locks", "locks-password", "elsewhere").await;
    let options = cluster
        .options(TTL)
        .with_user("locks")
        .with_password("locks-password");
    let locks = lock_on(options, quick_polling());
    let verified = locks.verify().await;
    assert_eq!(
        verified.err().map(|e| e.kind()),
        Some(ErrorKind::Misconfigured)
    );
}

/// A member that cannot be reached is named in the error with the cause the connection
/// reported, and the credentials are not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_member_is_named_with_the_cause_and_never_the_credentials() {
    let mut cluster = EtcdCluster::start(
        1,
        Auth::Root {
            token_ttl_secs: 300,
        },
    )
    .await;
    let options = cluster.options(TTL);
    let password = options
        .password
        .as_ref()
        .expect("a password")
        .expose()
        .to_owned();
    let locks = lock_on(options, quick_polling());
    cluster.kill(0);
    let error = locks
        .try_acquire(&unique_prefix("unreachable"))
        .await
        .expect_err("nobody answers");
    let message = error.to_string();
    eprintln!("{message}");
    assert_eq!(error.kind(), ErrorKind::Unavailable);
    assert!(message.contains(&cluster.endpoint(0)), "{message}");
    assert!(message.contains("Connection refused"), "{message}");
    assert!(!message.contains(&password), "{message}");
    let debug = format!("{error:?}");
    assert!(!debug.contains(&password), "{debug}");
}

/// `verify` passes on a healthy cluster and reports a cluster that is down as `Unavailable`,
/// sending nothing that takes a lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_checks_the_cluster_without_taking_a_lock() {
    let mut cluster = EtcdCluster::single().await;
    let locks = process(&cluster);
    locks.verify().await.expect("a healthy cluster");
    assert_eq!(backend(&locks).lease_id(), None, "verify granted a lease");
    assert_eq!(cluster.count("lockingkit/").await, 0);
    cluster.kill(0);
    let down = process(&cluster).verify().await;
    assert_eq!(down.err().map(|e| e.kind()), Some(ErrorKind::Unavailable));
}

/// Shutting down revokes the lease (every key of the backend goes at once), stops the watch
/// stream and leaves no delete unconfirmed. A clone still holding keeps the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_revokes_the_lease_unless_another_clone_still_holds() {
    let cluster = EtcdCluster::single().await;
    let shared = EtcdBackend::new(cluster.options(TTL)).expect("options");
    let engine = |backend: EtcdBackend| {
        DistributedLock::builder(backend)
            .options(quick_polling())
            .build()
            .expect("lock options")
    };
    let (first, second) = (engine(shared.clone()), engine(shared.clone()));
    let key = unique_prefix("shutdown");
    let kept = second
        .try_acquire(&format!("{key}/kept"))
        .await
        .expect("lock");
    let dropped = first
        .try_acquire(&format!("{key}/first"))
        .await
        .expect("lock");
    drop(dropped);
    first
        .shutdown(Duration::from_secs(10))
        .await
        .expect("shutdown");
    assert!(kept.is_held(), "another clone's hold survived");
    let mut client = cluster.client().await;
    assert_eq!(client.leases().await.expect("leases").leases().len(), 1);
    let lease = shared
        .lease_id()
        .expect("the lease the other clone holds on");
    kept.release().await.expect("release");
    second
        .shutdown(Duration::from_secs(10))
        .await
        .expect("shutdown");
    let leases = client.leases().await.expect("leases");
    assert!(
        leases.leases().iter().all(|l| l.id() != lease),
        "the lease outlived the last clone's shutdown"
    );
    assert_eq!(shared.watches(), 0);
    assert_eq!(shared.pending_deletes(), 0);
    assert_eq!(cluster.count("lockingkit/").await, 0);
}
