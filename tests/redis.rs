//! The Redis provider against real servers: the contract suite on one server and on a
//! three-primary Redis Cluster, interop with plain Redis commands through the documented key
//! mapping, the mapping against the server's own slot rule, fencing across a restart,
//! connection hygiene and error classification.
//!
//! Each test starts its own throwaway servers (see `lockingkit_tests::redis`).

use std::time::Duration;

use lockingkit::backend::{BackendErrorKind, LockBackend};
use lockingkit::keys::RedisLockKeys;
use lockingkit::providers::redis::RedisLease;
use lockingkit::testing::{quick_polling, unique_prefix};
use lockingkit::{
    DistributedLock, ErrorKind, LockError, LockHandle, LockMode, LockOptions, RedisBackend,
    RedisOptions,
};
use lockingkit_tests::checks::assert_token_grew;
use lockingkit_tests::contract::FixtureContract;
use lockingkit_tests::field_log::FieldLog;
use lockingkit_tests::proxy::{Fault, FaultProxy};
use lockingkit_tests::redis::{RedisCluster, RedisServer, TlsRedisServer};
use redis::AsyncCommands;
use tokio::time::Instant;

/// The lease of the contract runs: short, so the renewal case (over three leases) stays quick.
const LEASE: Duration = Duration::from_secs(3);
/// At most a third of the lease.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(1);

fn options(url: String, cluster: bool) -> RedisOptions {
    RedisOptions::new(url)
        .with_cluster(cluster)
        .with_lease_duration(LEASE)
        .with_request_timeout(REQUEST_TIMEOUT)
}

/// The retry delay of a waiter only a published release can wake in time.
const PATIENT: Duration = Duration::from_secs(5);

/// `options` for a waiter that retries `PATIENT` apart: a writer's intent that outlasts its
/// retries (the engine refuses one that does not), in a lease long enough to hold it.
fn patient(options: RedisOptions) -> RedisOptions {
    options
        .with_lease_duration(Duration::from_secs(10))
        .with_writer_intent(PATIENT + Duration::from_secs(1))
}

/// Engine options that retry `PATIENT` apart.
fn patient_polling() -> LockOptions {
    LockOptions::default()
        .with_min_retry_delay(PATIENT)
        .with_max_retry_delay(PATIENT)
}

fn backend(server: &RedisServer) -> RedisBackend {
    RedisBackend::new(options(server.url(), false)).expect("valid Redis options")
}

fn process(server: &RedisServer) -> DistributedLock {
    DistributedLock::builder(backend(server))
        .options(quick_polling())
        .build()
        .expect("valid lock options")
}

#[track_caller]
fn kind_of(result: Result<LockHandle, LockError>) -> ErrorKind {
    match result {
        Ok(handle) => panic!("expected an error, got a lock on {}", handle.key()),
        Err(error) => error.kind(),
    }
}

mod contract {
    use super::*;

    // Each "process" is a `DistributedLock` with its own backend (its own connections) on
    // one server.
    lockingkit::contract_tests!(async {
        FixtureContract::new(RedisServer::start().await, LEASE, backend)
    });

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_lease_is_released_exactly_once() {
        let server = RedisServer::start().await;
        lockingkit::testing::each_lease_is_released_exactly_once(|| backend(&server), LEASE).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_repeated_or_late_release_never_frees_the_next_holder() {
        let server = RedisServer::start().await;
        lockingkit::testing::a_repeated_or_late_release_never_frees_the_next_holder(|| {
            backend(&server)
        })
        .await;
    }
}

mod cluster_contract {
    use super::*;

    /// Each "process" has its own cluster client on one three-primary cluster.
    async fn cluster_contract() -> FixtureContract<RedisCluster, fn(&RedisCluster) -> RedisBackend>
    {
        FixtureContract::new(RedisCluster::start().await, LEASE, |cluster| {
            RedisBackend::new(options(cluster.urls().join(","), true))
                .expect("valid Redis Cluster options")
        })
    }

    lockingkit::contract_tests!(cluster_contract());

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_lease_is_released_exactly_once() {
        let contract = cluster_contract().await;
        lockingkit::testing::each_lease_is_released_exactly_once(|| contract.backend(), LEASE)
            .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_repeated_or_late_release_never_frees_the_next_holder() {
        let contract = cluster_contract().await;
        lockingkit::testing::a_repeated_or_late_release_never_frees_the_next_holder(|| {
            contract.backend()
        })
        .await;
    }
}

// ----------------------------------------------------------------------------------------------
// Interop: plain Redis commands and the documented key mapping
// ----------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cli_sees_the_holder_and_its_expiry_under_the_documented_name() {
    let server = RedisServer::start().await;
    let locks = process(&server);
    let key = unique_prefix("interop/inspect");
    let names = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key);
    let held = locks.try_acquire(&key).await.expect("a lock");

    let holder = server.cli(&["GET", &names.lock]);
    let lease = locks
        .backend::<RedisBackend>()
        .expect("a Redis lock")
        .lease_duration();
    assert_eq!(holder.len(), 32, "a 128-bit holder id in hex: {holder:?}");
    let ttl: u64 = server.cli(&["PTTL", &names.lock]).parse().expect("a TTL");
    assert!(ttl > 0 && ttl <= lease.as_millis() as u64, "PTTL {ttl}");
    let fence: u64 = server.cli(&["GET", &names.fence]).parse().expect("a token");
    assert_eq!(
        fence,
        held.fencing_token(),
        "the counter holds the holder's token"
    );

    held.release().await.expect("release");
    assert_eq!(server.cli(&["EXISTS", &names.lock]), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_set_nx_and_the_library_exclude_each_other() {
    let server = RedisServer::start().await;
    let locks = process(&server);
    let mut plain = server.client().await;
    let key = unique_prefix("interop/set-nx");
    let name = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).lock;

    // The library first: another program's SET NX on the documented name fails.
    let held = locks.try_acquire(&key).await.expect("library lock");
    let taken: bool = redis::cmd("SET")
        .arg(&name)
        .arg("other-program")
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async::<Option<String>>(&mut plain)
        .await
        .expect("SET NX")
        .is_some();
    assert!(!taken, "a plain SET NX took a key the library holds");
    held.release().await.expect("release");

    // The other program first: the library is told busy, and a wait times out (the server
    // answered busy throughout: contention, not an outage).
    let taken: Option<String> = redis::cmd("SET")
        .arg(&name)
        .arg("other-program")
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(&mut plain)
        .await
        .expect("SET NX");
    assert!(taken.is_some());
    assert_eq!(kind_of(locks.try_acquire(&key).await), ErrorKind::Busy);
    assert_eq!(
        kind_of(locks.acquire(&key, Duration::from_millis(300)).await),
        ErrorKind::Timeout
    );
    let _: () = plain.del(&name).await.expect("DEL");
    let held = locks
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("free once the other program deleted its key");
    held.release().await.expect("release");
}

/// The published script `name` (`lockingkit/src/providers/redis/lua/{name}.lua`), read as
/// another program would copy it.
fn published_script(name: &str) -> String {
    let path = format!(
        "{}/../lockingkit/src/providers/redis/lua/{name}.lua",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Runs the published script `name` with `EVAL`, as another program would.
async fn run_published(
    client: &mut redis::aio::MultiplexedConnection,
    name: &str,
    keys: &[&str],
    args: &[&str],
) -> i64 {
    redis::cmd("EVAL")
        .arg(published_script(name))
        .arg(keys.len())
        .arg(keys)
        .arg(args)
        .query_async(client)
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Another program with a plain client and only the published Lua files takes the very same
/// locks in every mode, and hears each release of a lock or a reader — its own or LockingKit's
/// — as the message `released` on the key's `released` channel; a semaphore release publishes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_program_takes_the_locks_with_the_published_scripts_and_hears_each_release() {
    use futures_util::StreamExt;

    let server = RedisServer::start().await;
    let locks = process(&server);
    let key = unique_prefix("other-program");
    let n = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key);
    let lock_keys = [n.lock.as_str(), &n.readers, &n.intent, &n.fence];
    let mut plain = server.client().await;
    let mut listener = redis::Client::open(server.url())
        .expect("a Redis URL")
        .get_async_pubsub()
        .await
        .expect("a pub/sub connection");
    listener.subscribe(&n.released).await.expect("subscribed");
    let mut heard = listener.into_on_message();
    let mut next_message = async || {
        let message = tokio::time::timeout(Duration::from_secs(5), heard.next())
            .await
            .expect("a message in time")
            .expect("the subscription stays");
        assert_eq!(message.get_channel_name(), n.released);
        String::from_utf8(message.get_payload_bytes().to_vec()).expect("text")
    };

    // A reader of the other program's keeps LockingKit's writer out, renews, releases.
    let token = run_published(&mut plain, "acquire_shared", &lock_keys, &["them", "30000"]).await;
    assert!(token > 0, "a fencing token: {token}");
    assert_eq!(kind_of(locks.try_acquire(&key).await), ErrorKind::Busy);
    assert_eq!(
        run_published(
            &mut plain,
            "renew_member",
            &[&n.readers],
            &["them", "30000"]
        )
        .await,
        1
    );
    let released = [n.released.as_str()];
    let args = ["them", released[0]];
    assert_eq!(
        run_published(&mut plain, "release_member", &[&n.readers], &args).await,
        1
    );
    assert_eq!(next_message().await, "released");

    // LockingKit's lock keeps the other program's writer out; its release is heard the same way.
    let held = locks.try_acquire(&key).await.expect("free again");
    let args = ["them", "30000", "2000"];
    assert_eq!(
        run_published(&mut plain, "acquire", &lock_keys, &args).await,
        0
    );
    let theirs_must_exceed = held.fencing_token();
    held.release().await.expect("release");
    assert_eq!(next_message().await, "released");

    // The other program's own lock: a greater token, renewed, released with the message.
    let token = run_published(&mut plain, "acquire", &lock_keys, &args).await;
    assert!(
        token > i64::try_from(theirs_must_exceed).expect("a token"),
        "{token}"
    );
    assert_eq!(kind_of(locks.try_acquire(&key).await), ErrorKind::Busy);
    assert_eq!(
        run_published(&mut plain, "renew", &[&n.lock], &["them", "30000"]).await,
        1
    );
    let args = ["them", released[0]];
    assert_eq!(
        run_published(&mut plain, "release", &[&n.lock], &args).await,
        1
    );
    assert_eq!(next_message().await, "released");

    // A semaphore place of the other program's counts against LockingKit's holders.
    let s = RedisLockKeys::semaphore(RedisLockKeys::DEFAULT_PREFIX, &key);
    let slot_keys = [s.holders.as_str(), &s.fence];
    let args = ["them", "30000", "1"];
    assert!(run_published(&mut plain, "acquire_slot", &slot_keys, &args).await > 0);
    let slots = locks.semaphore(&key, 1).expect("a semaphore");
    assert_eq!(kind_of(slots.try_acquire().await), ErrorKind::Busy);
    assert_eq!(
        run_published(
            &mut plain,
            "renew_member",
            &[&s.holders],
            &["them", "30000"]
        )
        .await,
        1
    );
    assert_eq!(
        run_published(&mut plain, "release_member", &[&s.holders], &["them", ""]).await,
        1
    );
    // Published nothing: the next message heard is one sent after it.
    let _: i64 = plain.publish(&n.released, "after").await.expect("publish");
    assert_eq!(next_message().await, "after");
    slots
        .try_acquire()
        .await
        .expect("free")
        .release()
        .await
        .expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_name_of_a_key_is_in_the_slot_the_cluster_computes() {
    let cluster = RedisCluster::start().await;
    let keys = [
        "orders/42".to_owned(),
        "a{b}c".to_owned(),
        "a~7Bb}c".to_owned(),
        "{}".to_owned(),
        "}".to_owned(),
        "{".to_owned(),
        "ключ".to_owned(),
        "🔒".repeat(512),
        "x".repeat(512),
    ];
    for key in keys {
        let lock = RedisLockKeys::lock("lockingkit", &key);
        let semaphore = RedisLockKeys::semaphore("lockingkit", &key);
        let slot = cluster.keyslot(&lock.lock);
        for name in [
            &lock.lock,
            &lock.readers,
            &lock.intent,
            &lock.fence,
            &semaphore.holders,
            &semaphore.fence,
        ] {
            assert_eq!(cluster.keyslot(name), slot, "CLUSTER KEYSLOT of a name");
            assert_eq!(RedisLockKeys::hash_slot(name), slot, "our slot rule");
        }
    }
}

/// A held lock's slot moves to another primary (`CLUSTER SETSLOT … IMPORTING/MIGRATING`, then
/// `MIGRATE` of its keys, then `SETSLOT … NODE`), as resharding does: renewals follow the slot
/// (answered by the old primary while the keys are there, redirected with `ASK` once they have
/// moved, with `MOVED` after), the lock is never lost, and it stays exclusive with growing
/// tokens on the new primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_survives_its_slot_migrating_to_another_primary() {
    let cluster = RedisCluster::start().await;
    let url = cluster.urls().join(",");
    let process = || {
        DistributedLock::builder(RedisBackend::new(options(url.clone(), true)).expect("options"))
            .options(quick_polling())
            .build()
            .expect("lock")
    };
    let (holder, other) = (process(), process());
    let key = unique_prefix("cluster/migrate");
    let names = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key);
    let held = holder.try_acquire(&key).await.expect("a lock");
    let slot = cluster.keyslot(&names.lock);
    let (source, target) = {
        let source = cluster.primary_of(slot);
        let target = cluster
            .nodes()
            .iter()
            .find(|node| node.port() != source.port())
            .expect("another primary");
        (source, target)
    };
    let id = |node: &RedisServer| node.cli(&["CLUSTER", "MYID"]);
    let (source_id, target_id) = (id(source), id(target));
    let slot_arg = slot.to_string();
    let setslot = |node: &RedisServer, state: &str, owner: &str| {
        assert_eq!(
            node.cli(&["CLUSTER", "SETSLOT", &slot_arg, state, owner]),
            "OK"
        );
    };
    // Renewed within the last second and a half, on `node`: a renewal reached it since. (Renewals
    // come every second; a lease not renewed for 1.5 s has at most 1.5 s left.)
    let renewed_on = |node: &RedisServer, stage: &str| {
        let ttl: i64 = node.cli(&["PTTL", &names.lock]).parse().expect("a TTL");
        eprintln!("{stage}: PTTL {ttl} ms");
        assert!(ttl > 1500, "{stage}: not renewed lately (PTTL {ttl} ms)");
    };
    setslot(target, "IMPORTING", &source_id);
    setslot(source, "MIGRATING", &target_id);
    // Renewals (every second) while the slot is migrating and its keys are still here.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    held.ensure_held().expect("held while migrating");
    renewed_on(source, "migrating");
    let keys = source.cli(&["CLUSTER", "GETKEYSINSLOT", &slot_arg, "100"]);
    let keys: Vec<&str> = keys.lines().collect();
    assert!(keys.contains(&names.lock.as_str()), "{keys:?}");
    let port = target.port().to_string();
    let mut migrate = vec!["MIGRATE", "127.0.0.1", &port, "", "0", "5000", "KEYS"];
    migrate.extend(keys.iter().copied());
    assert_eq!(source.cli(&migrate), "OK");
    // Renewals while the keys live on the target and the slot is still the source's.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    held.ensure_held().expect("held with its keys moved");
    // The target answers for the importing slot only after ASKING, as the client's redirected
    // renewals do.
    let (_, ttl): ((), i64) = redis::pipe()
        .cmd("ASKING")
        .cmd("PTTL")
        .arg(&names.lock)
        .query_async(&mut target.client().await)
        .await
        .expect("ASKING, PTTL");
    eprintln!("keys moved, slot not yet: PTTL {ttl} ms");
    assert!(
        ttl > 1500,
        "not renewed on the target lately (PTTL {ttl} ms)"
    );
    for node in cluster.nodes() {
        setslot(node, "NODE", &target_id);
    }
    // Renewals once the slot is the target's.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    held.ensure_held().expect("held on the new primary");
    renewed_on(target, "slot moved");
    assert_eq!(kind_of(other.try_acquire(&key).await), ErrorKind::Busy);
    let token = held.fencing_token();
    held.release().await.expect("released on the new primary");
    let next = other
        .try_acquire(&key)
        .await
        .expect("free after the release");
    assert!(
        next.fencing_token() > token,
        "the counter moved with the slot"
    );
    next.release().await.expect("release");
}

/// Fencing tokens keep growing when the server restarts without persistence: the counter is
/// gone, and the floor from the server's clock takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_growing_across_a_restart_without_persistence() {
    let mut server = RedisServer::start().await;
    let locks = process(&server);
    let key = unique_prefix("fencing/restart");
    let fence = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).fence;
    let mut last = 0;
    for _ in 0..3 {
        let held = locks.try_acquire(&key).await.expect("a lock");
        assert!(held.fencing_token() > last);
        last = held.fencing_token();
        held.release().await.expect("release");
    }
    server.restart().await;
    assert_eq!(
        server.cli(&["EXISTS", &fence]),
        "0",
        "the counter died with the server"
    );
    let held = locks
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("a lock after the restart");
    assert_token_grew(held, last, "a restart").await;
}

/// A counter that another program set far ahead of the clock keeps counting from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_ahead_of_the_clock_keeps_counting_up() {
    let server = RedisServer::start().await;
    let locks = process(&server);
    let key = unique_prefix("fencing/ahead");
    let fence = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).fence;
    // Far ahead of the clock in microseconds (year 2255 is about 9.0e15), but exact in a double.
    let ahead: u64 = 9_000_000_000_000_000;
    assert_eq!(server.cli(&["SET", &fence, &ahead.to_string()]), "OK");
    let held = locks.try_acquire(&key).await.expect("a lock");
    assert_eq!(held.fencing_token(), ahead + 1);
    held.release().await.expect("release");
    let held = locks.try_acquire(&key).await.expect("a lock");
    assert_eq!(held.fencing_token(), ahead + 2);
    held.release().await.expect("release");
    assert_eq!(server.cli(&["GET", &fence]), (ahead + 2).to_string());
}

/// A counter at 2^53 - 1 mints nothing (no greater token is exact in a double): the attempt is
/// refused with a permanent error and takes nothing; one below still mints the last exact one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_at_two_to_the_53_minus_one_mints_no_token() {
    let server = RedisServer::start().await;
    let locks = process(&server);
    let key = unique_prefix("fencing/exhausted");
    let names = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key);
    let last_exact: u64 = (1 << 53) - 1;
    assert_eq!(
        server.cli(&["SET", &names.fence, &(last_exact - 1).to_string()]),
        "OK"
    );
    let held = locks.try_acquire(&key).await.expect("the last exact token");
    assert_eq!(held.fencing_token(), last_exact);
    held.release().await.expect("release");
    let error = locks
        .try_acquire(&key)
        .await
        .expect_err("no exact token left");
    assert_eq!(error.kind(), ErrorKind::Backend, "{error}");
    assert!(error.to_string().contains("fencing counter"), "{error}");
    assert_eq!(server.cli(&["EXISTS", &names.lock]), "0", "nothing taken");
    assert_eq!(server.cli(&["GET", &names.fence]), last_exact.to_string());
}

/// A waiter whose backoff is 5 s: whatever the moment of the release (before its first
/// attempt, while its wait subscribes, long after), it holds the key a few milliseconds after
/// the release, which only the published release (or the wake once its subscription is in
/// place) can explain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_wakes_a_waiter_in_another_process_within_milliseconds() {
    let server = RedisServer::start().await;
    let holder = process(&server);
    // Retries a whole 5 s apart: only the published release can wake it in time.
    let backend = RedisBackend::new(patient(options(server.url(), false))).expect("options");
    let patient = DistributedLock::builder(backend)
        .options(patient_polling())
        .build()
        .expect("options");
    let key = unique_prefix("wake/release");
    let mut took = Vec::new();
    for hold_ms in [0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 100, 200, 300] {
        let held = holder.try_acquire(&key).await.expect("a lock");
        let waiter = {
            let (patient, key) = (patient.clone(), key.clone());
            tokio::spawn(async move {
                let handle = patient.acquire(&key, Duration::from_secs(30)).await;
                (Instant::now(), handle)
            })
        };
        tokio::time::sleep(Duration::from_millis(hold_ms)).await;
        let released = Instant::now();
        held.release().await.expect("release");
        let (got_at, handle) = waiter.await.expect("the waiter task");
        handle
            .expect("the waiter's lock")
            .release()
            .await
            .expect("release");
        took.push(got_at - released);
    }
    eprintln!("hand-offs after holds of 0 to 300 ms: {took:?}");
    assert!(
        took.iter().all(|t| *t < Duration::from_secs(1)),
        "a waiter slept out its backoff: {took:?}"
    );
    took.sort();
    let median = took[took.len() / 2];
    assert!(
        median < Duration::from_millis(50),
        "median hand-off {median:?}: {took:?}"
    );
    assert_eq!(
        patient
            .backend::<RedisBackend>()
            .map(RedisBackend::wait_connections),
        Some(1)
    );
}

/// How many scripts the server has run (`EVALSHA` calls) since its statistics were reset.
fn scripts_run(server: &RedisServer) -> u64 {
    let stats = server.cli(&["INFO", "commandstats"]);
    stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().expect("a count"))
}

/// A wait attempts once more when its subscription is in place — when the server confirms it,
/// or at once when it opens on a channel another wait has subscribed already — since a
/// release before that went unheard; then only when a release is published (here by another
/// program). The key is held by a plain `SET`, so every script the server runs is a waiter's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_attempts_again_once_subscribed_and_then_only_when_a_release_is_published() {
    let server = RedisServer::start().await;
    // A writer's intent outlasts the 5 s retries.
    let shared = RedisBackend::new(patient(options(server.url(), false))).expect("options");
    let first = DistributedLock::builder(shared.clone())
        .options(patient_polling())
        .build()
        .expect("options");
    let second = DistributedLock::builder(shared)
        .options(patient_polling())
        .build()
        .expect("options");
    let key = unique_prefix("wake/subscribed");
    let names = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key);
    server.cli(&["SET", &names.lock, "another-program", "PX", "60000"]);
    // Warm: the scripts cached on the server, outside the count.
    assert_eq!(kind_of(first.try_acquire(&key).await), ErrorKind::Busy);
    server.cli(&["CONFIG", "RESETSTAT"]);
    let waiting = {
        let (first, key) = (first.clone(), key.clone());
        tokio::spawn(async move { first.acquire(&key, Duration::from_secs(4)).await })
    };
    // Its busy answer, then one attempt when the server confirms the subscription.
    let started = Instant::now();
    while scripts_run(&server) < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "no second attempt"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        server.cli(&["PUBSUB", "NUMSUB", &names.released]),
        format!("{}\n1", names.released)
    );
    // A window to see nothing in: no further attempt without a release (its backoff is 5 s).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(scripts_run(&server), 2, "an attempt nothing woke");
    // Another wait on the subscribed channel: its busy answer and one attempt at once.
    let timed_out = second.acquire(&key, Duration::from_secs(1)).await;
    assert_eq!(kind_of(timed_out), ErrorKind::Timeout);
    assert_eq!(scripts_run(&server), 4, "two attempts per wait, no more");
    server.cli(&["DEL", &names.lock]);
    let released = Instant::now();
    server.cli(&["PUBLISH", &names.released, "released"]);
    let handle = waiting
        .await
        .expect("the waiter task")
        .expect("woken by the published release");
    assert!(released.elapsed() < Duration::from_secs(1));
    assert_eq!(scripts_run(&server), 5, "one attempt for the release");
    handle.release().await.expect("release");
}

/// A wait that ends — timed out or dropped — gives up its interest at once, and its channel is
/// unsubscribed once it has lingered (about a second, for the next wait of the key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_times_out_or_is_dropped_unsubscribes_its_channel_after_the_linger() {
    let server = RedisServer::start().await;
    let waiter = process(&server);
    let key = unique_prefix("wake/ended");
    let names = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key);
    server.cli(&["SET", &names.lock, "another-program", "PX", "60000"]);
    let subscribers = || {
        let answer = server.cli(&["PUBSUB", "NUMSUB", &names.released]);
        answer.lines().nth(1).map(str::to_owned).unwrap_or_default()
    };
    let until = |want: &'static str, what: &'static str| {
        let started = Instant::now();
        async move {
            while subscribers() != want {
                assert!(started.elapsed() < Duration::from_secs(5), "{what}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            started.elapsed()
        }
    };
    let error = waiter
        .acquire(&key, Duration::from_millis(300))
        .await
        .expect_err("held");
    assert_eq!(error.kind(), ErrorKind::Timeout);
    let gone = until("0", "the timed-out wait is still subscribed").await;
    eprintln!("timed-out wait unsubscribed {gone:?} after it ended");
    let dropped = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move { waiter.acquire(&key, Duration::from_secs(30)).await })
    };
    until("1", "never subscribed").await;
    dropped.abort();
    assert!(dropped.await.is_err_and(|e| e.is_cancelled()));
    let gone = until("0", "the dropped wait is still subscribed").await;
    eprintln!("dropped wait unsubscribed {gone:?} after it ended");
    server.cli(&["DEL", &names.lock]);
}

// ----------------------------------------------------------------------------------------------
// Errors, options and connections
// ----------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_is_down_is_unavailable_not_busy_or_timed_out() {
    let mut server = RedisServer::start().await;
    let locks = process(&server);
    server.kill();
    let key = unique_prefix("down");
    assert_eq!(
        kind_of(locks.try_acquire(&key).await),
        ErrorKind::Unavailable
    );
    assert_eq!(
        kind_of(locks.acquire(&key, Duration::from_millis(500)).await),
        ErrorKind::Unavailable
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_is_misconfigured_and_never_repeated() {
    let server = RedisServer::start_with(vec!["--requirepass".into(), "right-one".into()]).await;
    let url = format!("redis://:hunter2@127.0.0.1:{}", server.port());
    let backend = RedisBackend::new(options(url, false)).expect("options");
    let error = backend.verify().await.expect_err("a wrong password");
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert!(!format!("{error} {error:?}").contains("hunter2"));
    // Logins refused so far, as the server counts them (asked with the right password).
    let refused = || -> u64 {
        server
            .cli(&["-a", "right-one", "--no-auth-warning", "INFO", "errorstats"])
            .lines()
            .find_map(|line| line.strip_prefix("errorstat_WRONGPASS:count="))
            .map_or(0, |count| count.trim().parse().expect("a count"))
    };
    assert_eq!(refused(), 1, "the startup check's login");
    // Two seconds of attempts, first on the backend alone (its own outage gate), then through
    // an engine (whose gate comes first): each tries one login per probe, 50-100 ms after the
    // first failure and twice as long after each further one, so about five a gate.
    let mut attempts = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(2) {
        let error = backend
            .try_acquire("k", LockMode::Exclusive)
            .await
            .expect_err("a wrong password");
        assert_eq!(error.kind(), BackendErrorKind::Misconfigured, "{error}");
        attempts += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let logins = refused();
    eprintln!("{logins} refused logins for {attempts} attempts on the backend");
    assert!(attempts >= 100, "{attempts} attempts");
    assert!(
        logins <= 8,
        "{logins} refused logins for {attempts} attempts"
    );
    let locks = DistributedLock::builder(
        RedisBackend::new(options(
            format!("redis://:hunter2@127.0.0.1:{}", server.port()),
            false,
        ))
        .expect("options"),
    )
    .build()
    .expect("lock");
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(2) {
        let error = locks.try_acquire("k").await.expect_err("a wrong password");
        assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let more = refused() - logins;
    eprintln!("{more} refused logins through an engine");
    assert!(more <= 7, "{more} refused logins in 2 s through an engine");

    let right = format!("redis://:right-one@127.0.0.1:{}", server.port());
    let backend = RedisBackend::new(options(right, false)).expect("options");
    backend.verify().await.expect("the right password");
    assert!(!format!("{backend:?}").contains("right-one"));
}

/// A line that accepts connections and then answers nothing makes every connection attempt
/// (here, its `AUTH`) time out. That counts as a failure like a refused connection: requests
/// meanwhile fail at once without opening connections of their own, and one connect at a time
/// is tried, less and less often.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connects_that_time_out_back_off_instead_of_one_per_request() {
    let server = RedisServer::start_with(vec!["--requirepass".into(), "pw".into()]).await;
    let proxy = FaultProxy::to_port(server.port()).await;
    proxy.set_fault(Fault::Blackhole);
    let bare = RedisBackend::new(
        RedisOptions::new(format!("redis://:pw@127.0.0.1:{}", proxy.port()))
            .with_lease_duration(Duration::from_millis(300))
            .with_request_timeout(Duration::from_millis(100))
            .with_writer_intent(Duration::from_millis(300)),
    )
    .expect("options");
    let started = Instant::now();
    let mut attempts = 0;
    while started.elapsed() < Duration::from_secs(3) {
        let error = bare
            .try_acquire("k", LockMode::Exclusive)
            .await
            .expect_err("nothing answers");
        assert_eq!(
            error.kind(),
            BackendErrorKind::Transient { reached: false },
            "{error}"
        );
        attempts += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let connects = proxy.connections_accepted();
    // The first, then one per probe: 50-100 ms after the failure, each further one twice as long
    // after the last (jittered), so about five in three seconds whatever the number of requests.
    assert!(
        connects <= 8,
        "{connects} connection attempts for {attempts} requests"
    );
    // Refused at once, not after a connection attempt's timeout of their own.
    assert!(attempts >= 50, "{attempts} requests in 3 s");
}

/// Connections the server has accepted since it started (`INFO stats`), each `redis-cli` call
/// included.
fn connections_received(server: &RedisServer) -> u64 {
    server
        .cli(&["INFO", "stats"])
        .lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|count| count.trim().parse().ok())
        .expect("INFO stats counts connections")
}

/// A Redis 7 ACL user gets no pub/sub channels unless granted some: every subscription is
/// refused with NOPERM. The watch then stands down (waiters poll) and tries again only every
/// few seconds, instead of reconnecting each time the refusal closes its loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_channel_permissions_waits_by_polling_without_reconnecting_over_and_over() {
    let server = RedisServer::start().await;
    let created = server.cli(&[
        "ACL",
        "SETUSER",
        "locker",
        "on",
        ">pw",
        "~*",
        "+@all",
        "resetchannels",
    ]);
    assert_eq!(created, "OK");
    let holder = process(&server);
    let url = format!("redis://locker:pw@127.0.0.1:{}", server.port());
    let waiter = DistributedLock::builder(RedisBackend::new(options(url, false)).expect("options"))
        .options(quick_polling())
        .build()
        .expect("lock");
    let key = unique_prefix("noperm/wait");
    let held = holder.try_acquire(&key).await.expect("a lock");
    let before = connections_received(&server);
    let error = waiter
        .acquire(&key, Duration::from_secs(3))
        .await
        .expect_err("held throughout");
    assert_eq!(error.kind(), ErrorKind::Timeout, "{error}");
    // The waiter's lock connection and one refused pub/sub connection (tried again after 5 s),
    // plus this redis-cli call.
    let opened = connections_received(&server) - before;
    eprintln!("{opened} connections in 3 s of waiting");
    assert!(opened <= 3, "{opened} connections in 3 s of waiting");
    // Waiting still works, by polling.
    held.release().await.expect("release");
    let got = waiter
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("taken by polling once free");
    drop(got);
}

/// A pub/sub connection that keeps being lost right after it subscribed (here killed by
/// `CLIENT KILL TYPE pubsub` every 50 ms) is opened again after a growing backoff, not at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pub_sub_connection_lost_over_and_over_is_reopened_with_backoff() {
    let server = RedisServer::start().await;
    let proxy = FaultProxy::to_port(server.port()).await;
    let holder = process(&server);
    let waiter = DistributedLock::builder(
        RedisBackend::new(options(
            format!("redis://127.0.0.1:{}", proxy.port()),
            false,
        ))
        .expect("options"),
    )
    .options(quick_polling())
    .build()
    .expect("lock");
    let key = unique_prefix("pubsub/killed");
    let channel = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).released;
    let held = holder.try_acquire(&key).await.expect("a lock");
    let waiting = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move { waiter.acquire(&key, Duration::from_secs(30)).await })
    };
    let started = Instant::now();
    while !server.cli(&["PUBSUB", "NUMSUB", &channel]).ends_with('1') {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let before = proxy.connections_accepted();
    let killing = Instant::now();
    while killing.elapsed() < Duration::from_secs(3) {
        let port = server.port();
        tokio::task::spawn_blocking(move || {
            lockingkit_tests::redis::cli(port, &["CLIENT", "KILL", "TYPE", "pubsub"])
        })
        .await
        .expect("redis-cli");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reopened = proxy.connections_accepted() - before;
    eprintln!("{reopened} pub/sub connections in 3 s of kills");
    // 50-100 ms after the first loss, then twice as long after each: about five in 3 s.
    assert!(
        reopened <= 8,
        "{reopened} pub/sub connections in 3 s of kills"
    );
    held.release().await.expect("release");
    let got = waiting
        .await
        .expect("the waiter task")
        .expect("the waiter's lock");
    got.release().await.expect("release");
}

/// A user for `ACL SETUSER name on >pw …rules`, and a backend that connects as it.
fn user_backend(server: &RedisServer, name: &str, rules: &[&str]) -> RedisBackend {
    RedisBackend::new(user_options(server, name, rules)).expect("options")
}

/// The options of a user `name` with ACL `rules`, made (again) on `server`.
fn user_options(server: &RedisServer, name: &str, rules: &[&str]) -> RedisOptions {
    let mut args = vec!["ACL", "SETUSER", name, "reset", "on", ">pw"];
    args.extend_from_slice(rules);
    assert_eq!(server.cli(&args), "OK", "ACL SETUSER {name}");
    let url = format!("redis://{name}:pw@127.0.0.1:{}", server.port());
    options(url, false)
}

/// A user that may not use the release channels still releases: publishing a release is best
/// effort, so only waking other processes' waiters is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_channel_permissions_still_releases_every_mode() {
    let server = RedisServer::start().await;
    let backend = user_backend(&server, "no-channels", &["~*", "+@all", "resetchannels"]);
    let locks = DistributedLock::builder(backend).build().expect("lock");
    let key = unique_prefix("noperm/release");
    let names = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key);
    let held = locks.try_acquire(&key).await.expect("a lock");
    held.release()
        .await
        .expect("released although the publish is refused");
    assert_eq!(server.cli(&["EXISTS", &names.lock]), "0");
    let read = locks
        .reader_writer(&key)
        .expect("readers")
        .try_read()
        .await
        .expect("a read");
    read.release()
        .await
        .expect("released although the publish is refused");
    assert_eq!(server.cli(&["EXISTS", &names.readers]), "0");
    let slot = locks
        .semaphore(&key, 2)
        .expect("semaphore")
        .try_acquire()
        .await
        .expect("a slot");
    slot.release().await.expect("released");
}

/// The least a Redis user needs for every mode and for waking waiters (docs/redis.md,
/// "Permissions"); `+wait` too with `replicas`, `+config|get` for the startup check to read the
/// eviction policy.
const LOCKER_ACL: &[&str] = &[
    "~lockingkit:*",
    "&lockingkit:*",
    "+eval",
    "+evalsha",
    "+script|load",
    "+publish",
    "+subscribe",
    "+unsubscribe",
    "+ping",
    "+get",
    "+set",
    "+del",
    "+exists",
    "+pexpire",
    "+pttl",
    "+time",
    "+zadd",
    "+zrem",
    "+zscore",
    "+zcard",
    "+zremrangebyscore",
];

/// The documented least-privilege user passes the startup check and can lock, read, hold a
/// semaphore slot, renew, and be woken by another process's release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_least_privilege_user_can_do_everything_locks_need() {
    let server = RedisServer::start().await;
    let backend = user_backend(&server, "locker", LOCKER_ACL);
    backend.verify().await.expect("the startup check passes");
    let (holder, waiter) = (
        DistributedLock::builder(backend).build().expect("lock"),
        DistributedLock::builder(
            RedisBackend::new(patient(user_options(&server, "locker", LOCKER_ACL)))
                .expect("options"),
        )
        .options(patient_polling())
        .build()
        .expect("lock"),
    );
    let key = unique_prefix("acl/least");
    let held = holder.try_acquire(&key).await.expect("a lock");
    let read_key = format!("{key}/read");
    let read = holder
        .reader_writer(&read_key)
        .expect("readers")
        .try_read()
        .await
        .expect("a read");
    let slot = holder
        .semaphore(&key, 2)
        .expect("semaphore")
        .try_acquire()
        .await
        .expect("a slot");
    let waiting = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move { waiter.acquire(&key, Duration::from_secs(30)).await })
    };
    // Held past two renewals (every second with the 3 s lease).
    tokio::time::sleep(LEASE).await;
    for handle in [&held, &read, &slot] {
        handle.ensure_held().expect("renewed");
    }
    let released = Instant::now();
    held.release().await.expect("release");
    let got = waiting.await.expect("the waiter").expect("woken");
    assert!(
        released.elapsed() < Duration::from_secs(2),
        "woken by the release, not the 5 s backoff"
    );
    for handle in [got, read, slot] {
        handle.release().await.expect("release");
    }
}

/// A command of a lock script, or a key of the prefix, refused to the user is `Misconfigured`
/// (a waiter stops at once), not a `Backend` failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_and_keys_refused_to_the_user_are_misconfigured() {
    let server = RedisServer::start().await;
    let key = unique_prefix("noperm/commands");
    let no_zadd = DistributedLock::builder(user_backend(
        &server,
        "no-zadd",
        &["~*", "&*", "+@all", "-zadd"],
    ))
    .build()
    .expect("lock");
    let error = no_zadd
        .reader_writer(&key)
        .expect("readers")
        .try_read()
        .await
        .expect_err("ZADD refused inside the script");
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    let other_keys = DistributedLock::builder(user_backend(
        &server,
        "other-keys",
        &["~other:*", "&*", "+@all"],
    ))
    .build()
    .expect("lock");
    let error = other_keys
        .try_acquire(&key)
        .await
        .expect_err("keys refused");
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert!(error.to_string().contains("NOPERM"), "{error}");
}

/// A refused permission is an answer: the connection stays (only refused credentials make a
/// new one), so a user that may not lock costs the server no reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_permission_keeps_the_connection() {
    let server = RedisServer::start().await;
    let bare = user_backend(&server, "other-keys", &["~other:*", "&*", "+@all"]);
    let before = connections_received(&server);
    for _ in 0..20 {
        let error = bare
            .try_acquire("noperm/keys", LockMode::Exclusive)
            .await
            .expect_err("keys refused");
        assert_eq!(error.kind(), BackendErrorKind::Misconfigured, "{error}");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // The backend's one connection, and this redis-cli call.
    assert_eq!(connections_received(&server) - before, 2);
}

/// The startup check names the channel permission a user lacks, and passes for one that has
/// what locks need.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_refuses_a_user_that_may_not_publish_or_subscribe_on_the_prefix_channels() {
    let server = RedisServer::start().await;
    for (name, rules, missing) in [
        (
            "no-channels",
            vec!["~*", "+@all", "resetchannels"],
            "publish on",
        ),
        (
            "no-publish",
            vec!["~*", "+@all", "-publish", "&lockingkit:*"],
            "publish on",
        ),
        (
            "no-subscribe",
            vec!["~*", "+@all", "-subscribe", "&lockingkit:*"],
            "subscribe to",
        ),
        (
            "other-channels",
            vec!["~*", "+@all", "&other:*"],
            "publish on",
        ),
    ] {
        let error = user_backend(&server, name, &rules)
            .verify()
            .await
            .expect_err("a permission is missing");
        assert_eq!(error.kind(), ErrorKind::Misconfigured, "{name}: {error}");
        let text = error.to_string();
        assert!(text.contains(missing), "{name}: {text}");
        assert!(text.contains("`&lockingkit:*`"), "{name}: {text}");
    }
    user_backend(&server, "locker", LOCKER_ACL)
        .verify()
        .await
        .expect("the user has what locks need");
}

/// What LockingKit logs while `work` runs on this thread (the test runs on one).
async fn logged_while<F: std::future::Future>(work: F) -> (F::Output, String) {
    use tracing_subscriber::layer::SubscriberExt;
    let log = FieldLog::default();
    let capturing =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(log.clone()));
    let output = work.await;
    drop(capturing);
    (output, log.text())
}

/// An eviction policy can delete a held lock: the startup check warns about any policy but
/// `noeviction`, says so when it may not read the policy, and is quiet otherwise.
#[tokio::test]
async fn verify_warns_when_redis_may_evict_locks() {
    let evicting =
        RedisServer::start_with(vec!["--maxmemory-policy".into(), "allkeys-lru".into()]).await;
    let (checked, log) = logged_while(backend(&evicting).verify()).await;
    checked.expect("a warning, not a failure");
    assert!(
        log.contains("maxmemory-policy allkeys-lru") && log.contains("noeviction"),
        "{log}"
    );

    let server = RedisServer::start().await;
    let (checked, log) = logged_while(backend(&server).verify()).await;
    checked.expect("the default policy is noeviction");
    assert!(!log.contains("maxmemory-policy"), "{log}");

    let (checked, log) = logged_while(user_backend(&server, "locker", LOCKER_ACL).verify()).await;
    checked.expect("a user without CONFIG passes");
    assert!(log.contains("could not read maxmemory-policy"), "{log}");
}

/// An attempt that went out and got no answer in time may still run on the server and take the
/// lock: its holder id is given back after it, so the key does not stay taken for a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_that_timed_out_is_given_back_after_it_runs() {
    let server = RedisServer::start().await;
    let proxy = FaultProxy::to_port(server.port()).await;
    let bare = RedisBackend::new(options(
        format!("redis://127.0.0.1:{}", proxy.port()),
        false,
    ))
    .expect("options");
    let key = unique_prefix("timed-out/attempt");
    let name = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).lock;
    // Connected and the script cached, then every request reaches the server after the timeout.
    let warm = bare
        .try_acquire(&key, LockMode::Exclusive)
        .await
        .expect("attempt")
        .expect("free");
    bare.release(&warm.lease).await.expect("release");
    proxy.set_latency(REQUEST_TIMEOUT + Duration::from_millis(300));
    let error = bare
        .try_acquire(&key, LockMode::Exclusive)
        .await
        .expect_err("no answer in time");
    assert_eq!(
        error.kind(),
        BackendErrorKind::Transient { reached: false },
        "{error}"
    );
    let started = Instant::now();
    let mut seen_taken = false;
    loop {
        match server.cli(&["EXISTS", &name]).as_str() {
            "1" => seen_taken = true,
            _ if seen_taken => break,
            _ => {}
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "taken: {seen_taken}, and never given back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        started.elapsed() < LEASE,
        "given back, not left to its lease"
    );
}

#[test]
fn invalid_options_are_refused_at_construction_with_every_problem() {
    let error = RedisBackend::new(
        RedisOptions::new("http://:hunter2@127.0.0.1")
            .with_lease_duration(Duration::from_millis(10))
            .with_key_prefix(""),
    )
    .expect_err("invalid options");
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    let text = error.to_string();
    for field in ["url", "key_prefix", "lease_duration"] {
        assert!(text.contains(field), "{field} missing from: {text}");
    }
    assert!(!text.contains("hunter2"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_held_locks_share_one_connection_and_leave_nothing_behind() {
    let server = RedisServer::start().await;
    let locks = process(&server);
    let prefix = unique_prefix("many");
    let mut held = Vec::new();
    for i in 0..1000 {
        held.push(
            locks
                .try_acquire(&format!("{prefix}/{i}"))
                .await
                .expect("a lock"),
        );
    }
    // Clients other than redis-cli itself: the one multiplexed connection.
    let clients = server.cli(&["CLIENT", "LIST"]);
    let ours = clients
        .lines()
        .filter(|l| !l.contains("cmd=client"))
        .count();
    assert_eq!(ours, 1, "{clients}");
    for handle in held {
        handle.release().await.expect("release");
    }
    assert_eq!(
        server.cli(&["DBSIZE"]),
        "1000",
        "only the fencing counters remain"
    );
    let keys = server.cli(&["KEYS", "*"]);
    assert!(keys.lines().all(|k| k.ends_with(":fence")), "{keys}");
}

/// Shutting a provider down closes its lock connection and its pub/sub connection, and wakes
/// its waiters; the other process's connection stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_the_lock_and_the_pub_sub_connections() {
    let server = RedisServer::start().await;
    let (holder, waiter) = (process(&server), process(&server));
    let key = unique_prefix("shutdown");
    let held = holder.try_acquire(&key).await.expect("a lock");
    let mine = waiter
        .try_acquire(&format!("{key}/mine"))
        .await
        .expect("a lock");
    let waiting = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move { waiter.acquire(&key, Duration::from_secs(30)).await })
    };
    let channel = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).released;
    let started = Instant::now();
    while !server.cli(&["PUBSUB", "NUMSUB", &channel]).ends_with('1') {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        lock_clients(&server),
        (3, 1),
        "two lock connections, one subscribed"
    );
    waiter
        .shutdown(Duration::from_secs(5))
        .await
        .expect("shut down in time");
    let error = waiting
        .await
        .expect("the waiter task")
        .expect_err("ended by the shutdown");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(!mine.is_held(), "given up at shutdown");
    let started = Instant::now();
    while lock_clients(&server) != (1, 0) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "still connected after the shutdown: {:?}",
            lock_clients(&server)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        server.cli(&[
            "EXISTS",
            &RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &format!("{key}/mine")).lock
        ]),
        "0",
        "released at shutdown"
    );
    held.release()
        .await
        .expect("the other process is unaffected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_log_shows_no_errors_after_a_busy_run() {
    let server = RedisServer::start().await;
    let (a, b) = (process(&server), process(&server));
    let key = unique_prefix("log");
    for _ in 0..20 {
        let held = a.try_acquire(&key).await.expect("lock");
        assert_eq!(kind_of(b.try_acquire(&key).await), ErrorKind::Busy);
        held.release().await.expect("release");
        let read = b
            .reader_writer(&key)
            .expect("rw")
            .try_read()
            .await
            .expect("read");
        read.release().await.expect("release");
    }
    assert_eq!(server.warnings_since_ready(), Vec::<String>::new());
    // Not even NOSCRIPT: each connection loads a script before it first runs it.
    assert_eq!(server.error_replies(), Vec::<(String, u64)>::new());
}

// ----------------------------------------------------------------------------------------------
// What the server sees: the script cache and the connection handshake
// ----------------------------------------------------------------------------------------------

/// The modes the script-cache cases hold in: between them they run all seven scripts.
const MODES: [LockMode; 3] = [
    LockMode::Exclusive,
    LockMode::Shared,
    LockMode::Semaphore { max_count: 2 },
];
/// How many scripts the protocol has (`lockingkit::providers::redis::lua`).
const SCRIPTS: u64 = 7;

/// Takes `per_mode` leases in every mode, all at once, on distinct keys under `prefix`.
async fn take_at_once(backend: &RedisBackend, prefix: &str, per_mode: usize) -> Vec<RedisLease> {
    let mut tasks = tokio::task::JoinSet::new();
    for (m, mode) in MODES.into_iter().enumerate() {
        for i in 0..per_mode {
            let backend = backend.clone();
            let key = format!("{prefix}/{m}/{i}");
            tasks.spawn(async move {
                let taken = backend.try_acquire(&key, mode).await.expect("an attempt");
                taken.expect("a free key").lease
            });
        }
    }
    tasks.join_all().await
}

/// Renews every lease, all at once.
async fn renew_at_once(backend: &RedisBackend, leases: Vec<RedisLease>) -> Vec<RedisLease> {
    let mut tasks = tokio::task::JoinSet::new();
    for lease in leases {
        let backend = backend.clone();
        tasks.spawn(async move {
            backend.renew(&lease).await.expect("a renewal");
            lease
        });
    }
    tasks.join_all().await
}

/// Releases every lease, all at once.
async fn release_at_once(backend: &RedisBackend, leases: Vec<RedisLease>) {
    let mut tasks = tokio::task::JoinSet::new();
    for lease in leases {
        let backend = backend.clone();
        tasks.spawn(async move { backend.release(&lease).await.expect("a release") });
    }
    tasks.join_all().await;
}

/// A connection loads each script (`SCRIPT LOAD`) before it first runs it, once however many
/// requests need it at that moment, and sends it by SHA from then on: 16 holds in each mode
/// starting at once on an empty script cache draw no `NOSCRIPT`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_loads_each_script_once_however_many_holds_start_at_once() {
    let server = RedisServer::start().await;
    // Another process's startup check cached every script; an operator flushed them.
    backend(&server).verify().await.expect("verify");
    server.flush_scripts();
    server.reset_stats();
    let fresh = backend(&server);
    let leases = take_at_once(&fresh, &unique_prefix("fresh-cache"), 16).await;
    let leases = renew_at_once(&fresh, leases).await;
    release_at_once(&fresh, leases).await;
    assert_eq!(server.error_replies(), Vec::<(String, u64)>::new());
    assert_eq!(
        server.calls_of("script|load"),
        SCRIPTS,
        "one load per script"
    );
    assert_eq!(
        server.calls_of("evalsha"),
        3 * 48,
        "each request once, by SHA"
    );
    assert_eq!(server.calls_of("eval"), 0, "no script sent whole");
}

/// A `SCRIPT FLUSH` under an open connection: the attempts already sent answer `NOSCRIPT`, each
/// once (retried after the reload, none draws a second), and the connection then loads every
/// script again before its next use of it, once each, so the renewals and releases that follow
/// draw none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_flush_under_an_open_connection_reloads_each_script_once() {
    let server = RedisServer::start().await;
    let backend = backend(&server);
    let prefix = unique_prefix("flushed-cache");
    let warm = take_at_once(&backend, &prefix, 16).await;
    release_at_once(&backend, renew_at_once(&backend, warm).await).await;
    server.flush_scripts();
    server.reset_stats();
    let leases = take_at_once(&backend, &prefix, 16).await;
    let in_flight = server.error_count("NOSCRIPT");
    assert!(in_flight <= 48, "{in_flight} NOSCRIPT for 48 attempts");
    let leases = renew_at_once(&backend, leases).await;
    release_at_once(&backend, leases).await;
    assert_eq!(
        server.error_replies(),
        match in_flight {
            0 => vec![],
            n => vec![("NOSCRIPT".to_owned(), n)],
        },
        "renewals and releases draw none"
    );
    assert_eq!(
        server.calls_of("script|load"),
        SCRIPTS,
        "one reload per script"
    );
    assert_eq!(server.calls_of("eval"), 0, "no script sent whole");
}

/// On a cluster every node's connection loads a script before it first runs it there, and sends
/// no `CLIENT SETINFO` (which Redis 7.0 answers with `ERR`): a 1,002-key run in every mode
/// leaves each node with no error reply and seven loads; after a `SCRIPT FLUSH` on every node,
/// only attempts in flight at the flush draw `NOSCRIPT` (once each), and each node's
/// connection loads each script once again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_each_node_loads_each_script_once_and_answers_no_handshake_error() {
    let cluster = RedisCluster::start().await;
    let backend = RedisBackend::new(options(cluster.urls().join(","), true)).expect("options");
    let prefix = unique_prefix("cluster-cache");
    let leases = take_at_once(&backend, &prefix, 334).await;
    release_at_once(&backend, renew_at_once(&backend, leases).await).await;
    let replies: Vec<Vec<(String, u64)>> = cluster
        .nodes()
        .iter()
        .map(RedisServer::error_replies)
        .collect();
    assert_eq!(replies, vec![vec![]; 3], "each node's error replies");
    for (n, node) in cluster.nodes().iter().enumerate() {
        assert_eq!(node.calls_of("script|load"), SCRIPTS, "node {n}");
        node.flush_scripts();
        node.reset_stats();
    }
    let leases = take_at_once(&backend, &prefix, 334).await;
    let in_flight: Vec<u64> = cluster
        .nodes()
        .iter()
        .map(|node| node.error_count("NOSCRIPT"))
        .collect();
    assert!(in_flight.iter().sum::<u64>() <= 1002, "{in_flight:?}");
    release_at_once(&backend, renew_at_once(&backend, leases).await).await;
    backend
        .verify()
        .await
        .expect("verify, on connections of its own");
    for (n, node) in cluster.nodes().iter().enumerate() {
        let expected = match in_flight[n] {
            0 => vec![],
            count => vec![("NOSCRIPT".to_owned(), count)],
        };
        assert_eq!(
            node.error_replies(),
            expected,
            "node {n}: after the attempts"
        );
        // The run's reloads, and the startup check's own loads.
        assert_eq!(node.calls_of("script|load"), 2 * SCRIPTS, "node {n}");
        assert_eq!(node.calls_of("eval"), 0, "node {n}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_answers_through_the_trait_without_the_engine() {
    let server = RedisServer::start().await;
    let bare = backend(&server);
    let key = unique_prefix("bare");
    let first = bare
        .try_acquire(&key, LockMode::Exclusive)
        .await
        .expect("attempt")
        .expect("free");
    assert!(
        bare.try_acquire(&key, LockMode::Exclusive)
            .await
            .expect("attempt")
            .is_none(),
        "busy"
    );
    assert_eq!(
        server.cli(&["GET", first.lease.redis_key()]),
        first.lease.holder_id()
    );
    bare.renew(&first.lease).await.expect("renew");
    bare.release(&first.lease).await.expect("release");
    let gone = bare
        .renew(&first.lease)
        .await
        .expect_err("renew after release");
    assert_eq!(
        gone.kind(),
        lockingkit::backend::BackendErrorKind::LeaseGone
    );
}

// ----------------------------------------------------------------------------------------------
// Readers, writers and semaphores on Redis
// ----------------------------------------------------------------------------------------------

/// The Redis rule: an exclusive attempt that finds live readers sets the key's intent for
/// `writer_intent` (2 s), and every process's readers are refused while it stands; the readers
/// holding then finish, their releases publish, and the writer gets in within about one read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_writer_holds_new_readers_back_in_every_process_and_gets_in_after_one_read() {
    const READ: Duration = Duration::from_millis(200);
    let server = RedisServer::start().await;
    let (writer, first, second) = (process(&server), process(&server), process(&server));
    let key = unique_prefix("rw/intent");
    let intent = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).intent;
    let reader = first
        .reader_writer(&key)
        .expect("readers")
        .try_read()
        .await
        .expect("read");
    let read_until = Instant::now() + READ;
    let asked = Instant::now();
    let waiting = {
        let writer = writer.clone();
        let key = key.clone();
        tokio::spawn(async move { writer.acquire(&key, Duration::from_secs(30)).await })
    };
    // The writer's first attempt found the reader: the intent stands, for every process.
    let started = Instant::now();
    while server.cli(&["EXISTS", &intent]) != "1" {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no intent was set"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for readers in [&first, &second] {
        let error = readers
            .reader_writer(&key)
            .expect("readers")
            .try_read()
            .await
            .expect_err("a new reader while a writer waits");
        assert_eq!(error.kind(), ErrorKind::Busy, "{error}");
    }
    tokio::time::sleep_until(read_until).await;
    reader.release().await.expect("release the reader");
    let released = Instant::now();
    let held = waiting.await.expect("the writer task").expect("the writer");
    let waited = asked.elapsed();
    // Woken by the reader's release, not by its backoff (quick polling retries within 100 ms;
    // the bound leaves room for a loaded machine).
    assert!(
        released.elapsed() < Duration::from_millis(300),
        "the writer got in {:?} after the last reader left",
        released.elapsed()
    );
    assert!(
        waited < READ + Duration::from_millis(500),
        "waited {waited:?}"
    );
    assert_eq!(
        server.cli(&["EXISTS", &intent]),
        "0",
        "the intent ends with the write"
    );
    held.release().await.expect("release");
    // Once the writer is gone, readers get in at once.
    let again = second
        .reader_writer(&key)
        .expect("readers")
        .try_read()
        .await
        .expect("read");
    again.release().await.expect("release");
}

/// A semaphore holder that stops renewing (its process crashed) keeps its slot until its lease
/// runs out, and not longer; each holder has its own expiry and fencing token in the sorted set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_semaphore_holder_frees_its_slot_when_its_lease_runs_out() {
    let server = RedisServer::start().await;
    let key = unique_prefix("semaphore/crash");
    let holders = RedisLockKeys::semaphore(RedisLockKeys::DEFAULT_PREFIX, &key).holders;
    // The crashed holder: a slot taken through the backend alone, never renewed or released.
    let crashed = backend(&server);
    let abandoned = crashed
        .try_acquire(&key, lockingkit::LockMode::Semaphore { max_count: 2 })
        .await
        .expect("attempt")
        .expect("a free slot");
    let taken_at = Instant::now();
    let locks = process(&server);
    let semaphore = locks.semaphore(&key, 2).expect("a semaphore");
    let live = semaphore.try_acquire().await.expect("the second slot");
    assert!(
        live.fencing_token() > abandoned.fencing_token,
        "tokens grow per holder"
    );
    assert_eq!(
        kind_of(semaphore.try_acquire().await),
        ErrorKind::Busy,
        "both slots taken"
    );
    // redis-cli shows both holders with their expiries (Unix ms).
    let listed = server.cli(&["ZRANGE", &holders, "0", "-1", "WITHSCORES"]);
    assert!(listed.contains(abandoned.lease.holder_id()), "{listed}");
    assert_eq!(listed.lines().count(), 4, "{listed}");
    let freed = semaphore
        .acquire(Duration::from_secs(30))
        .await
        .expect("the crashed holder's slot, once its lease ran out");
    let after = taken_at.elapsed();
    assert!(
        after >= LEASE - Duration::from_millis(50),
        "freed after {after:?}"
    );
    assert!(
        after <= LEASE + Duration::from_millis(500),
        "freed after {after:?}"
    );
    // The live holder was renewed meanwhile and still holds.
    assert!(live.is_held());
    freed.release().await.expect("release");
    live.release().await.expect("release");
    assert_eq!(
        server.cli(&["EXISTS", &holders]),
        "0",
        "the set goes with its last holder"
    );
}

/// Every attempt is one round trip, busy or not, in every mode (once the server has the
/// scripts), counted by a proxy in front of the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attempt_is_one_round_trip_in_every_mode() {
    let server = RedisServer::start().await;
    let proxy = FaultProxy::to_port(server.port()).await;
    let counted = DistributedLock::builder(
        RedisBackend::new(options(
            format!("redis://127.0.0.1:{}", proxy.port()),
            false,
        ))
        .expect("options"),
    )
    .options(quick_polling())
    .build()
    .expect("lock");
    let other = process(&server);
    let key = unique_prefix("round-trips");
    let rw = counted.reader_writer(&key).expect("readers");
    let semaphore = counted.semaphore(&key, 1).expect("semaphore");
    let exchanges = || proxy.exchanges().len();
    // Warm: every script cached on the server.
    for _ in 0..2 {
        counted
            .try_acquire(&key)
            .await
            .expect("lock")
            .release()
            .await
            .expect("release");
        rw.try_read()
            .await
            .expect("read")
            .release()
            .await
            .expect("release");
        semaphore
            .try_acquire()
            .await
            .expect("slot")
            .release()
            .await
            .expect("release");
    }
    let before = exchanges();
    let held = counted.try_acquire(&key).await.expect("lock");
    assert_eq!(exchanges() - before, 1, "exclusive attempt");
    let before = exchanges();
    held.release().await.expect("release");
    assert_eq!(exchanges() - before, 1, "release");
    let before = exchanges();
    let read = rw.try_read().await.expect("read");
    assert_eq!(exchanges() - before, 1, "shared attempt");
    let before = exchanges();
    let slot = semaphore.try_acquire().await.expect("slot");
    assert_eq!(exchanges() - before, 1, "semaphore attempt");
    let other_slot = other.semaphore(&key, 1).expect("semaphore");
    assert_eq!(kind_of(other_slot.try_acquire().await), ErrorKind::Busy);
    let blocker = other
        .try_acquire(&format!("{key}/busy"))
        .await
        .expect("lock");
    let before = exchanges();
    assert_eq!(
        kind_of(counted.try_acquire(&format!("{key}/busy")).await),
        ErrorKind::Busy
    );
    assert_eq!(exchanges() - before, 1, "a busy attempt");
    for handle in [read, slot, blocker] {
        handle.release().await.expect("release");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_section_binds_from_configuration_and_lists_every_problem_without_the_password() {
    use lockingkit::registry::{Locking, LockingConfig};
    let server = RedisServer::start().await;
    let config = LockingConfig::new().with_section(
        "Default",
        serde_json::json!({
            "provider": "redis",
            "url": server.url(),
            "lease_duration": "3s",
            "request_timeout": "500ms",
            "max_retry_delay": "200ms",
        }),
    );
    let locking = Locking::from_config(config).expect("a valid Redis section");
    let locks = locking.default_lock();
    assert_eq!(locks.provider(), "redis");
    let held = locks
        .try_acquire(&unique_prefix("config"))
        .await
        .expect("a lock");
    held.release().await.expect("release");

    let bad = LockingConfig::new().with_section(
        "Default",
        serde_json::json!({
            "provider": "redis",
            "url": "redis://:hunter2@127.0.0.1:1,redis://other:2",
            "lease_duration": "2s",
            "request_timeout": "1s",
            "key_prefix": "",
        }),
    );
    let error = Locking::from_config(bad).expect_err("invalid options");
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    let text = error.to_string();
    for expected in [
        "Locking.Default.url names several nodes",
        "Locking.Default.key_prefix",
        "Locking.Default.request_timeout",
    ] {
        assert!(text.contains(expected), "{expected} missing from: {text}");
    }
    assert!(!text.contains("hunter2"), "{text}");

    // A comparison with a setting that did not parse is left out: it would judge the default.
    let unparsed = LockingConfig::new().with_section(
        "Default",
        serde_json::json!({
            "provider": "redis",
            "url": server.url(),
            "lease_duration": "soon",
            "request_timeout": "20s",
        }),
    );
    let error = Locking::from_config(unparsed).expect_err("an unparsed lease");
    let text = error.to_string();
    assert!(text.contains("Locking.Default.lease_duration"), "{text}");
    assert!(!text.contains("request_timeout"), "{text}");
}

/// A writer's intent that could lapse between two of its attempts is refused however the lock
/// is built: from configuration, by the registry's builder and by `DistributedLock::builder`.
#[test]
fn a_writer_intent_no_longer_than_max_retry_delay_is_refused() {
    use lockingkit::registry::{Locking, LockingConfig};
    let config = LockingConfig::new().with_section(
        "Default",
        serde_json::json!({
            "provider": "redis",
            "url": "redis://127.0.0.1:1",
            "max_retry_delay": "3s",
        }),
    );
    let error = Locking::from_config(config).expect_err("the default intent is 2s");
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    assert!(
        error.to_string().contains(
            "Locking.Default.writer_intent (default 2s) must be longer than max_retry_delay (3s)"
        ),
        "{error}"
    );
    let error = Locking::builder()
        .redis(
            "Jobs",
            RedisOptions::new("redis://127.0.0.1:1"),
            LockOptions::default().with_max_retry_delay(Duration::from_secs(2)),
        )
        .build()
        .expect_err("an intent equal to the delay");
    assert!(
        error.to_string().contains("Locking.Jobs.writer_intent"),
        "{error}"
    );
    let longer =
        RedisOptions::new("redis://127.0.0.1:1").with_writer_intent(Duration::from_secs(4));
    let slow = LockOptions::default().with_max_retry_delay(Duration::from_secs(3));
    Locking::builder()
        .redis("Default", longer.clone(), slow.clone())
        .build()
        .expect("an intent longer than the delay");

    let backend = RedisBackend::new(RedisOptions::new("redis://127.0.0.1:1")).expect("options");
    let error = DistributedLock::builder(backend)
        .max_retry_delay(Duration::from_secs(3))
        .build()
        .expect_err("the default intent is 2s");
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    assert!(
        error
            .to_string()
            .contains("writer_intent (2s) must be longer than max_retry_delay (3s)"),
        "{error}"
    );
    DistributedLock::builder(RedisBackend::new(longer).expect("options"))
        .options(slow)
        .build()
        .expect("an intent longer than the delay");
}

/// The clients of `node` that are neither replication links nor `redis-cli` asking, and how many
/// of them are subscribed (flag `P`).
fn lock_clients(node: &RedisServer) -> (usize, usize) {
    let list = node.cli(&["CLIENT", "LIST"]);
    let ours: Vec<&str> = list
        .lines()
        .filter(|line| !line.contains("cmd=client"))
        .filter(|line| {
            let flags = line
                .split_whitespace()
                .find_map(|field| field.strip_prefix("flags="))
                .unwrap_or("");
            !flags.contains('S') && !flags.contains('M')
        })
        .collect();
    let subscribed = ours.iter().filter(|line| line.contains("flags=P")).count();
    (ours.len(), subscribed)
}

/// At most one connection per node per backend (the cluster client keeps one to every node of
/// its slot map, replicas included), however many locks are held, plus one pub/sub connection
/// for a process that waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_backend_uses_one_connection_per_node_and_one_to_wait() {
    let cluster = RedisCluster::start_with_replicas(1).await;
    let url = cluster.urls().join(",");
    let process = || {
        DistributedLock::builder(RedisBackend::new(options(url.clone(), true)).expect("options"))
            .options(quick_polling())
            .build()
            .expect("lock")
    };
    let holder = process();
    let prefix = unique_prefix("cluster-budget");
    let mut held = Vec::new();
    for i in 0..200 {
        held.push(
            holder
                .try_acquire(&format!("{prefix}/{i}"))
                .await
                .expect("a lock"),
        );
    }
    let counts: Vec<(usize, usize)> = cluster.nodes().iter().map(lock_clients).collect();
    assert!(counts.iter().all(|&(all, _)| all <= 1), "{counts:?}");
    assert!(
        counts[..3].iter().all(|&(all, _)| all == 1),
        "each primary: {counts:?}"
    );

    // A waiter in another process adds its own connections and one subscribed connection.
    let waiter = process();
    let key = format!("{prefix}/0");
    let waiting = {
        let waiter = waiter.clone();
        let key = key.clone();
        tokio::spawn(async move { waiter.acquire(&key, Duration::from_secs(30)).await })
    };
    // Subscribed, as one of the nodes says (pub/sub state is per node).
    let channel = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).released;
    let started = Instant::now();
    while !cluster
        .nodes()
        .iter()
        .any(|node| node.cli(&["PUBSUB", "NUMSUB", &channel]).ends_with('1'))
    {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        waiter
            .backend::<RedisBackend>()
            .map(RedisBackend::wait_connections),
        Some(1),
        "counted once subscribed"
    );
    let counts: Vec<(usize, usize)> = cluster.nodes().iter().map(lock_clients).collect();
    let subscribed: usize = counts.iter().map(|c| c.1).sum();
    assert_eq!(subscribed, 1, "{counts:?}");
    assert!(
        counts
            .iter()
            .all(|&(all, subscribed)| all - subscribed <= 2),
        "two backends, at most one connection each per node: {counts:?}"
    );
    for handle in held {
        handle.release().await.expect("release");
    }
    let got = waiting
        .await
        .expect("the waiter task")
        .expect("the waiter's lock");
    got.release().await.expect("release");
    // Nor did any of those connections, replicas' and the pub/sub one included, draw an error
    // reply (`CLIENT SETINFO`, which Redis 7.0 answers with `ERR`, or `NOSCRIPT`).
    let replies: Vec<Vec<(String, u64)>> = cluster
        .nodes()
        .iter()
        .map(RedisServer::error_replies)
        .collect();
    assert_eq!(replies, vec![vec![]; 6], "each node's error replies");
}

/// A wait that ends leaves no subscription behind, even while releases of other keys keep the
/// pub/sub connection busy, and the connection closes once nothing is waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_waits_leave_no_subscription_and_the_wait_connection_closes_when_idle() {
    let server = RedisServer::start().await;
    let (holder, waiter) = (process(&server), process(&server));
    let prefix = unique_prefix("subscriptions");
    let (quiet, busy) = (format!("{prefix}/quiet"), format!("{prefix}/busy"));
    let channel = |key: &str| RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, key).released;
    let quiet_held = holder.try_acquire(&quiet).await.expect("lock");
    // The busy key is taken and released every 100 ms, while a waiter of the other process
    // keeps waiting for it: its channel hears a release ten times a second.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (holder, waiter, busy, stop) =
            (holder.clone(), waiter.clone(), busy.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let held = holder
                    .acquire(&busy, Duration::from_secs(5))
                    .await
                    .expect("lock");
                let wait = {
                    let (waiter, busy) = (waiter.clone(), busy.clone());
                    tokio::spawn(async move {
                        waiter
                            .acquire(&busy, Duration::from_secs(5))
                            .await
                            .map(drop)
                    })
                };
                tokio::time::sleep(Duration::from_millis(100)).await;
                held.release().await.expect("release");
                wait.await.expect("the wait").expect("the waiter got it");
            }
        })
    };
    let error = waiter
        .acquire(&quiet, Duration::from_millis(300))
        .await
        .expect_err("held");
    assert_eq!(error.kind(), ErrorKind::Timeout);
    let all = || server.cli(&["PUBSUB", "CHANNELS", "*"]);
    let started = Instant::now();
    while all().contains(&channel(&quiet)) || !all().contains(&channel(&busy)) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the ended wait is still subscribed: {}",
            all()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    churn.await.expect("the churn task");
    quiet_held.release().await.expect("release");
    let watch = waiter.backend::<RedisBackend>().expect("Redis");
    let started = Instant::now();
    while watch.wait_connections() != 0
        || server
            .cli(&["PUBSUB", "NUMSUB", &channel(&busy)])
            .ends_with('1')
    {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the pub/sub connection stayed open with nothing waited for"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ----------------------------------------------------------------------------------------------
// TLS (rediss://) on one server
// ----------------------------------------------------------------------------------------------

/// Options for the TLS port of `server`, trusting the authority that signed its certificate.
fn tls_options(server: &TlsRedisServer) -> RedisOptions {
    options(server.tls_url(), false).with_tls_root_cert(server.ca())
}

/// The connections on `port` of `node`, as its `CLIENT LIST` says (`laddr`), not counting
/// the listing's own.
fn clients_on_port(node: &RedisServer, port: u16) -> usize {
    let laddr = format!("laddr=127.0.0.1:{port} ");
    node.cli(&["CLIENT", "LIST"])
        .lines()
        .filter(|line| !line.contains("cmd=client") && line.contains(&laddr))
        .count()
}

mod tls_contract {
    use super::*;

    // Each "process" has its own backend on the TLS port of one server.
    lockingkit::contract_tests!(async {
        FixtureContract::new(TlsRedisServer::start().await, LEASE, |server| {
            RedisBackend::new(tls_options(server)).expect("valid TLS options")
        })
    });
}

/// Locks, waiting and the startup check over TLS: the lock connection and the pub/sub
/// connection are both on the TLS port (the plain port carries only this test's inspection), a
/// password in the URL logs in over TLS, and a release wakes a waiter in another process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rediss_url_takes_locks_and_wakes_waiters_over_tls() {
    let tls = TlsRedisServer::start().await;
    let server = tls.server();
    let rules = ["+@all", "~*", "&*"];
    let mut args = vec!["ACL", "SETUSER", "locker", "reset", "on", ">tls-secret"];
    args.extend_from_slice(&rules);
    assert_eq!(server.cli(&args), "OK");
    let url = format!("rediss://locker:tls-secret@127.0.0.1:{}", tls.tls_port());
    let process = || {
        let backend = RedisBackend::new(patient(tls_options(&tls)).with_url(url.clone()))
            .expect("TLS options");
        assert!(!format!("{backend:?}").contains("tls-secret"));
        DistributedLock::builder(backend)
            .options(patient_polling())
            .build()
            .expect("lock options")
    };
    let (holder, waiter) = (process(), process());
    holder
        .backend::<RedisBackend>()
        .expect("Redis")
        .verify()
        .await
        .expect("the startup check over TLS");
    let key = unique_prefix("tls/wake");
    let names = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key);
    let held = holder.try_acquire(&key).await.expect("a lock over TLS");
    let first_token = held.fencing_token();
    assert_eq!(
        server.cli(&["GET", &names.fence]),
        held.fencing_token().to_string()
    );
    let waiting = {
        let (waiter, key) = (waiter.clone(), key.clone());
        tokio::spawn(async move {
            let handle = waiter.acquire(&key, Duration::from_secs(30)).await;
            (Instant::now(), handle)
        })
    };
    let started = Instant::now();
    while !server
        .cli(&["PUBSUB", "NUMSUB", &names.released])
        .ends_with('1')
    {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Two lock connections and the waiter's pub/sub connection, all on the TLS port.
    assert_eq!(clients_on_port(server, tls.tls_port()), 3);
    assert_eq!(clients_on_port(server, server.port()), 0);
    let released = Instant::now();
    held.release().await.expect("release over TLS");
    let (got_at, handle) = waiting.await.expect("the waiter task");
    let handle = handle.expect("the waiter's lock");
    assert!(
        got_at - released < Duration::from_secs(1),
        "woken {:?} after the release: its retry was 5 s away",
        got_at - released
    );
    assert!(handle.fencing_token() > first_token);
    handle.release().await.expect("release");
    assert_eq!(server.cli(&["EXISTS", &names.lock]), "0");
}

/// A certificate the client does not trust is a misconfiguration (no retry fixes it) found by
/// the startup check and by every attempt; a plain port leaves the handshake unanswered, which
/// is transient like any connect that times out, but says what to check. No message carries
/// the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_certificate_or_a_plain_port_is_misconfigured() {
    let tls = TlsRedisServer::start().await;
    let other = TlsRedisServer::start().await;
    let secret_url = |port: u16| format!("rediss://:hunter2@127.0.0.1:{port}");
    let cases = [
        (
            "the platform's trust store",
            options(secret_url(tls.tls_port()), false),
            "not trusted",
            BackendErrorKind::Misconfigured,
        ),
        (
            "another authority",
            options(secret_url(tls.tls_port()), false).with_tls_root_cert(other.ca()),
            "not trusted",
            BackendErrorKind::Misconfigured,
        ),
        (
            "a host the certificate does not name",
            options(
                format!("rediss://:hunter2@localhost:{}", tls.tls_port()),
                false,
            )
            .with_tls_root_cert(tls.ca()),
            "not trusted",
            BackendErrorKind::Misconfigured,
        ),
        (
            "the plain port",
            options(secret_url(tls.server().port()), false).with_tls_root_cert(tls.ca()),
            "serve TLS on this port",
            BackendErrorKind::Transient { reached: false },
        ),
    ];
    for (case, options, expected, kind) in cases {
        let backend = RedisBackend::new(options).expect("valid options");
        let error = backend.verify().await.expect_err(case);
        let reported = match kind {
            BackendErrorKind::Misconfigured => ErrorKind::Misconfigured,
            _ => ErrorKind::Unavailable,
        };
        assert_eq!(error.kind(), reported, "{case}: {error}");
        let text = format!("{error} {error:?}");
        assert!(text.contains(expected), "{case}: {text}");
        assert!(!text.contains("hunter2"), "{case}: {text}");
        let error = backend
            .try_acquire("k", LockMode::Exclusive)
            .await
            .expect_err(case);
        assert_eq!(error.kind(), kind, "{case}: {error}");
    }
}

/// A `tls_root_cert` that cannot be used, or one without `rediss://`, and TLS on a cluster are
/// refused when the backend is built, each naming its setting.
#[test]
fn unusable_tls_settings_are_refused_at_construction() {
    let dir = std::env::temp_dir().join(unique_prefix("tls-settings"));
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    let not_pem = dir.join("not-a-certificate.pem");
    std::fs::write(&not_pem, "hello").expect("a file");
    let cases = [
        (
            "rediss://127.0.0.1:6380",
            false,
            Some(not_pem.clone()),
            "tls_root_cert",
        ),
        (
            "rediss://127.0.0.1:6380",
            false,
            Some(dir.join("missing.pem")),
            "tls_root_cert",
        ),
        (
            "redis://127.0.0.1:6379",
            false,
            Some(not_pem.clone()),
            "does not use TLS",
        ),
        ("rediss://127.0.0.1:7000", true, None, "one server only"),
    ];
    for (url, cluster, root, expected) in cases {
        let mut with_root = options(url.to_owned(), cluster);
        with_root.tls_root_cert = root;
        let error = match RedisBackend::new(with_root) {
            Ok(_) => panic!("{url} with {expected:?} was accepted"),
            Err(error) => error,
        };
        assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
        assert!(error.to_string().contains(expected), "{url}: {error}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
