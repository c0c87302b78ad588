//! Faults injected into real etcd clusters: the leader killed under a hundred holds, quorum
//! lost, the whole cluster restarted, a holder's key taken away by another client, and holder
//! processes killed or paused (SIGSTOP) past their lease.
//!
//! Holder processes are this test binary run again as a child (`holder_process`, ignored
//! unless the parent sets `LOCKINGKIT_ETCD_HOLDER`): it takes the lock, says so on stdout, and
//! says so again if it finds the lock lost.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use lockingkit::testing::{quick_polling, unique_prefix};
use lockingkit::{DistributedLock, ErrorKind, EtcdBackend, EtcdOptions, LockHandle};
use lockingkit_tests::etcd::EtcdCluster;
use tokio::time::Instant;

const HOLDER_ENV: &str = "LOCKINGKIT_ETCD_HOLDER";

fn lock_on(options: EtcdOptions) -> DistributedLock {
    DistributedLock::builder(EtcdBackend::new(options).expect("options"))
        .options(quick_polling())
        .build()
        .expect("lock options")
}

fn backend(lock: &DistributedLock) -> &EtcdBackend {
    lock.backend::<EtcdBackend>().expect("an etcd-backed lock")
}

/// A hundred holds survive the loss of the leader: the followers elect a new one, renewals
/// resume on it and no hold reaches its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_under_a_hundred_holds_loses_none() {
    let mut cluster = EtcdCluster::three().await;
    let ttl = Duration::from_secs(6);
    let locks = lock_on(cluster.options(ttl));
    let prefix = unique_prefix("leader-killed");
    let mut holds = Vec::new();
    for i in 0..100 {
        holds.push(
            locks
                .try_acquire(&format!("{prefix}/{i}"))
                .await
                .expect("lock"),
        );
    }
    let leader = cluster.leader().await;
    cluster.kill(leader);
    let killed = Instant::now();
    let renewals_before = backend(&locks).keep_alives_sent();
    // Two TTLs: every hold's deadline would have passed twice without renewals.
    while killed.elapsed() < ttl * 2 {
        assert!(
            holds.iter().all(LockHandle::is_held),
            "a hold was lost after {:?}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        backend(&locks).keep_alives_sent() > renewals_before,
        "renewals resumed"
    );
    let other = lock_on(cluster.options(ttl));
    for (i, hold) in holds.into_iter().enumerate() {
        let key = format!("{prefix}/{i}");
        assert_eq!(
            other.try_acquire(&key).await.err().map(|e| e.kind()),
            Some(ErrorKind::Busy)
        );
        hold.release()
            .await
            .expect("release after the leader change");
    }
    cluster.restart(leader).await;
}

/// With two of three members gone there is no quorum: holders cannot renew and are lost at
/// their deadline, and nobody is granted the lock meanwhile. Once the members are back, the
/// lock can be taken again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_quorum_loses_holders_at_their_deadline_and_grants_nothing() {
    let mut cluster = EtcdCluster::three().await;
    let ttl = Duration::from_secs(3);
    let holder = lock_on(cluster.options(ttl));
    let other = lock_on(cluster.options(ttl));
    let key = unique_prefix("quorum-lost");
    let held = holder.try_acquire(&key).await.expect("lock");
    let token = held.fencing_token();
    let (a, b) = (1, 2);
    cluster.kill(a);
    cluster.kill(b);
    let killed = Instant::now();
    while held.is_held() {
        let attempt = other.try_acquire(&key).await;
        assert!(attempt.is_err(), "the lock was granted without a quorum");
        assert!(
            killed.elapsed() < ttl + Duration::from_secs(1),
            "the holder outlived its deadline"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Lost at the deadline: 90% of the TTL after the last renewal sent, which was at most a
    // third of the TTL before the kill.
    assert!(killed.elapsed() >= ttl * 9 / 10 - ttl / 3 - Duration::from_millis(100));
    assert!(held.lost_token().is_cancelled());
    let during = other.try_acquire(&key).await;
    assert_eq!(during.err().map(|e| e.kind()), Some(ErrorKind::Unavailable));
    cluster.restart(a).await;
    cluster.restart(b).await;
    cluster.until_serving().await;
    let again = other
        .acquire(&key, ttl * 4)
        .await
        .expect("the lock is free again once the quorum is back");
    assert!(again.fencing_token() > token);
    again.release().await.expect("release");
}

/// Restarting every member keeps the revision counter: fencing tokens still grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_the_whole_cluster_keeps_tokens_growing() {
    let mut cluster = EtcdCluster::three().await;
    let ttl = Duration::from_secs(3);
    let key = unique_prefix("cluster-restarted");
    let before = {
        let locks = lock_on(cluster.options(ttl));
        let held = locks.try_acquire(&key).await.expect("lock");
        let token = held.fencing_token();
        held.release().await.expect("release");
        token
    };
    for member in 0..cluster.size() {
        cluster.kill(member);
    }
    for member in 0..cluster.size() {
        cluster.restart(member).await;
    }
    cluster.until_serving().await;
    let locks = lock_on(cluster.options(ttl));
    let held = locks
        .acquire(&key, Duration::from_secs(30))
        .await
        .expect("lock after the restart");
    assert!(
        held.fencing_token() > before,
        "token {} after {before}",
        held.fencing_token()
    );
    held.release().await.expect("release");
}

/// Another client deleting or overwriting the holder's key is loss at once, long before the
/// next renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holders_key_deleted_or_overwritten_by_another_client_is_loss_at_once() {
    let cluster = EtcdCluster::single().await;
    let locks = lock_on(cluster.options(Duration::from_secs(30)));
    let mut client = cluster.client().await;
    for overwrite in [false, true] {
        let key = unique_prefix("key-taken");
        let held = locks.try_acquire(&key).await.expect("lock");
        // Past the engine's start of the hold's watch (about 10 ms after the acquire).
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(held.is_held());
        let directory =
            lockingkit::providers::etcd::EtcdLockKeys::lock_directory("lockingkit/", &key);
        let found = client
            .get(
                directory,
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .expect("get");
        let holder_key = found.kvs()[0].key().to_vec();
        let taken = Instant::now();
        if overwrite {
            client
                .put(holder_key, "someone else", None)
                .await
                .expect("put");
        } else {
            client.delete(holder_key, None).await.expect("delete");
        }
        tokio::time::timeout(Duration::from_secs(1), held.lost_token().cancelled())
            .await
            .expect("loss within a second, not at the renewal ten seconds on");
        assert!(taken.elapsed() < Duration::from_secs(1));
        assert_eq!(
            held.ensure_held().err().map(|e| e.kind()),
            Some(ErrorKind::Lost)
        );
    }
}

/// A holder process that dies without releasing frees its key when its lease expires, not
/// before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_process_frees_the_key_when_its_lease_expires() {
    let cluster = EtcdCluster::single().await;
    let ttl = Duration::from_secs(3);
    let key = unique_prefix("holder-killed");
    let (mut child, mut lines) = spawn_holder(&cluster, &key, ttl);
    let token = expect_line(&mut lines, "HELD");
    child.signal(libc::SIGKILL);
    child.wait();
    let killed = Instant::now();
    let other = lock_on(cluster.options(ttl));
    assert_eq!(
        other.try_acquire(&key).await.err().map(|e| e.kind()),
        Some(ErrorKind::Busy)
    );
    let next = other
        .acquire(&key, ttl * 3)
        .await
        .expect("free once the lease expired");
    let freed = killed.elapsed();
    assert!(
        freed <= ttl + Duration::from_secs(2),
        "freed after {freed:?}"
    );
    assert!(
        freed >= ttl / 2,
        "freed after only {freed:?}: before the lease could expire"
    );
    assert!(next.fencing_token() > token);
    next.release().await.expect("release");
}

/// A holder paused (SIGSTOP) past its TTL loses the key to the next holder; when it wakes, it
/// finds its lock lost instead of carrying on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_lease_finds_the_lock_lost_when_it_wakes() {
    let cluster = EtcdCluster::single().await;
    let ttl = Duration::from_secs(3);
    let key = unique_prefix("holder-paused");
    let (mut child, mut lines) = spawn_holder(&cluster, &key, ttl);
    let token = expect_line(&mut lines, "HELD");
    child.signal(libc::SIGSTOP);
    let other = lock_on(cluster.options(ttl));
    let next = other
        .acquire(&key, ttl * 3)
        .await
        .expect("free once the lease expired");
    assert!(next.fencing_token() > token);
    child.signal(libc::SIGCONT);
    expect_line(&mut lines, "LOST");
    assert!(next.is_held(), "the woken holder took nothing back");
    next.release().await.expect("release");
    child.wait();
}

/// A holder process, killed when the test ends however it ends (a failed assertion included),
/// so no child outlives its test.
struct Holder(Child);

impl Holder {
    fn signal(&self, signal: i32) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe {
            libc::kill(self.0.id() as i32, signal);
        }
    }

    fn wait(&mut self) {
        let _ = self.0.wait();
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts this binary again as a holder of `key`.
fn spawn_holder(
    cluster: &EtcdCluster,
    key: &str,
    ttl: Duration,
) -> (Holder, BufReader<ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "holder_process",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(
            HOLDER_ENV,
            format!("{}|{key}|{}", cluster.endpoint(0), ttl.as_secs()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the holder process");
    let stdout = child.stdout.take().expect("stdout");
    (Holder(child), BufReader::new(stdout))
}

/// Reads lines until one says `word`; returns the number after it.
fn expect_line(lines: &mut BufReader<ChildStdout>, word: &str) -> u64 {
    let mut line = String::new();
    loop {
        line.clear();
        let read = lines
            .read_line(&mut line)
            .expect("read the holder's output");
        assert!(read > 0, "the holder process ended before saying {word}");
        // libtest writes `test holder_process ... ` before the test's own output.
        if let Some((_, rest)) = line.split_once(word) {
            return rest.trim().parse().unwrap_or(0);
        }
    }
}

/// The holder half of the process tests: does nothing unless started by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by the holder tests"]
async fn holder_process() {
    let Ok(spec) = std::env::var(HOLDER_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, '|');
    let (Some(endpoint), Some(key), Some(ttl)) = (parts.next(), parts.next(), parts.next()) else {
        return;
    };
    let ttl = Duration::from_secs(ttl.parse().expect("ttl"));
    let options = EtcdOptions {
        lease_ttl: ttl,
        request_timeout: ttl / 3,
        ..EtcdOptions::new([endpoint])
    };
    let locks = lock_on(options);
    let held = locks.try_acquire(key).await.expect("the holder's lock");
    println!("HELD {}", held.fencing_token());
    held.lost_token().cancelled().await;
    println!("LOST");
}
