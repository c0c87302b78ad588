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
use lockingkit::{DistributedLock, ErrorKind, EtcdBackend, EtcdOptions};
use lockingkit_tests::etcd::EtcdCluster;
use lockingkit_tests::proxy::{Fault, FaultProxy};
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
            holds.iter().all(|hold| hold.is_held()),
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
    assert_eq!(held.loss_reason(), Some(lockingkit::LossReason::Deadline));
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
    let ttl = Duration::from_secs(6);
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
        // The hold's watch is on the stream (the engine starts it about 10 ms after the
        // acquire).
        let watched = Instant::now() + Duration::from_secs(5);
        while backend(&locks).watches() == 0 {
            assert!(Instant::now() < watched, "the hold is not watched");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(held.is_held());
        let directory = lockingkit::keys::EtcdLockKeys::lock_directory("lockingkit/", &key);
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
    let token = expect_held(&mut lines);
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
    // The lease expires a TTL after the last keep-alive, sent at most a third of the TTL
    // before the kill.
    assert!(
        freed >= ttl - ttl / 3 - Duration::from_millis(200),
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
    let token = expect_held(&mut lines);
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

/// Reads lines until one says `word`; returns what follows it on the line.
fn expect_line(lines: &mut BufReader<ChildStdout>, word: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let read = lines
            .read_line(&mut line)
            .expect("read the holder's output");
        assert!(read > 0, "the holder process ended before saying {word}");
        // libtest writes `test holder_process ... ` before the test's own output.
        if let Some((_, rest)) = line.split_once(word) {
            return rest.trim().to_owned();
        }
    }
}

/// Reads the holder's `HELD {token}` line: the fencing token it was given.
fn expect_held(lines: &mut BufReader<ChildStdout>) -> u64 {
    let token = expect_line(lines, "HELD");
    token
        .parse()
        .unwrap_or_else(|_| panic!("the holder said HELD without a token: {token:?}"))
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

/// The process's CPU time so far (user and system), to tell waiting from spinning.
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes only into the struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.unsigned_abs())
            + Duration::from_micros(t.tv_usec.unsigned_abs())
    };
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// With every member down, an attempt fails at once and the process does not spin: requests
/// are not resent in a loop, background deletes back off, and while the members stay down
/// nothing is sent but one probe per member and backoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_that_is_down_is_waited_for_not_spun_on() {
    let mut cluster = EtcdCluster::single().await;
    let locks = lock_on(cluster.options(Duration::from_secs(6)));
    let warm = locks
        .try_acquire(&unique_prefix("down-warm"))
        .await
        .expect("lock");
    warm.release().await.expect("release");
    cluster.kill(0);
    let (cpu, started) = (cpu_time(), Instant::now());
    let attempt = locks.try_acquire(&unique_prefix("down")).await;
    assert_eq!(
        attempt.err().map(|e| e.kind()),
        Some(ErrorKind::Unavailable)
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the attempt took {:?}",
        started.elapsed()
    );
    let mut waits = Vec::new();
    for i in 0..20 {
        let (locks, key) = (locks.clone(), unique_prefix(&format!("down-{i}")));
        waits.push(tokio::spawn(async move {
            locks.acquire(&key, Duration::from_secs(3)).await
        }));
    }
    for wait in waits {
        let result = wait.await.expect("task");
        assert_eq!(result.err().map(|e| e.kind()), Some(ErrorKind::Unavailable));
    }
    // Idle with the cluster still down: nothing left running.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spent = cpu_time().saturating_sub(cpu);
    eprintln!("{spent:?} of CPU in {:?}", started.elapsed());
    assert!(
        spent < Duration::from_millis(500),
        "{spent:?} of CPU in {:?} of waiting for a cluster that is down",
        started.elapsed()
    );
    assert_eq!(
        backend(&locks).pending_deletes(),
        0,
        "a request that was never sent wrote nothing"
    );
}

/// The line to the only member resets every connection (a middlebox, a member restarting)
/// while fifty holds renew every 10 to 100 ms until their deadline: the member is asked again
/// only after a backoff, one connect at a time, not once per renewal, and the holds are lost
/// at their deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_resets_connections_is_probed_with_backoff_not_per_request() {
    let cluster = EtcdCluster::single().await;
    let line = FaultProxy::to_port(port_of(&cluster.endpoint(0))).await;
    let locks = lock_on(EtcdOptions {
        endpoints: vec![format!("http://127.0.0.1:{}", line.port())],
        ..cluster.options(Duration::from_secs(6))
    });
    let prefix = unique_prefix("reset");
    let mut holds = Vec::new();
    for i in 0..50 {
        holds.push(
            locks
                .try_acquire(&format!("{prefix}/{i}"))
                .await
                .expect("lock"),
        );
    }
    let before = line.connections_accepted();
    line.set_fault(Fault::Reset);
    let started = Instant::now();
    for hold in &holds {
        tokio::time::timeout(Duration::from_secs(12), hold.lost_token().cancelled())
            .await
            .expect("lost at the deadline");
        assert_eq!(hold.loss_reason(), Some(lockingkit::LossReason::Deadline));
    }
    let elapsed = started.elapsed();
    let connects = line.connections_accepted() - before;
    eprintln!("{connects} connects in {elapsed:?} of renewals by 50 holds");
    // Keep-alives and the watch stream back off (100 ms and 50 ms, doubling): a few connects
    // each over the holds' last seconds, where one per renewal would be hundreds.
    assert!(
        connects <= 20,
        "{connects} connects to a member that resets them, in {elapsed:?}"
    );
}

fn port_of(endpoint: &str) -> u16 {
    endpoint
        .rsplit(':')
        .next()
        .and_then(|port| port.parse().ok())
        .expect("an endpoint with a port")
}

/// A release whose caller stopped waiting for it (the release timeout passed while the line
/// was blackholed) and whose request never reached the server: the key is deleted in the
/// background once the line is back, not left for the lease that other holds keep alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_cut_short_still_deletes_the_key() {
    let cluster = EtcdCluster::single().await;
    let line = FaultProxy::to_port(port_of(&cluster.endpoint(0))).await;
    let options = EtcdOptions {
        endpoints: vec![format!("http://127.0.0.1:{}", line.port())],
        ..cluster.options(Duration::from_secs(6))
    };
    let locks = DistributedLock::builder(EtcdBackend::new(options).expect("options"))
        .options(lockingkit::LockOptions {
            release_timeout: Duration::from_millis(200),
            ..quick_polling()
        })
        .build()
        .expect("lock options");
    let key = unique_prefix("release-cut");
    let keeper = locks
        .try_acquire(&format!("{key}/keeper"))
        .await
        .expect("lock");
    let cut = locks
        .try_acquire(&format!("{key}/cut"))
        .await
        .expect("lock");
    let directory =
        lockingkit::keys::EtcdLockKeys::lock_directory("lockingkit/", &format!("{key}/cut"));
    line.set_fault(Fault::Blackhole);
    assert!(
        cut.release().await.is_err(),
        "the release cannot be confirmed"
    );
    // The delete never reaches the server: the connection holding it is reset.
    line.set_fault(Fault::Reset);
    let reset = Instant::now() + Duration::from_secs(5);
    while line.connections_open() > 0 {
        assert!(
            Instant::now() < reset,
            "the proxy did not reset its connections"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(cluster.count(&directory).await, 1, "the key is still there");
    line.set_fault(Fault::Pass);
    let gone = Instant::now() + Duration::from_secs(5);
    while cluster.count(&directory).await != 0 {
        assert!(
            Instant::now() < gone,
            "the released key was left for the lease"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        keeper.is_held(),
        "the lease lives on: only the delete removed the key"
    );
    keeper.release().await.expect("release");
}

/// A lock attempt that the leader proposed but could not commit in time is answered "request
/// timed out" — an answer, yet the write may still apply once the followers are back. Its key
/// is left to the background deletes like that of an attempt that went unanswered, so it does
/// not block the lock for the life of the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_an_attempt_answered_request_timed_out_may_have_written_is_deleted() {
    let mut cluster = EtcdCluster::three().await;
    let leader = cluster.leader().await;
    // The leader's own timeout (5 s plus two election timeouts) must come before ours, and the
    // lease outlive the test: only a delete removes the key.
    let options = EtcdOptions {
        endpoints: vec![cluster.endpoint(leader)],
        lease_ttl: Duration::from_secs(60),
        request_timeout: Duration::from_secs(15),
        ..cluster.options(Duration::from_secs(60))
    };
    let locks = lock_on(options);
    let key = unique_prefix("timed-out");
    let warm = locks
        .try_acquire(&format!("{key}/warm"))
        .await
        .expect("lock");
    let directory = lockingkit::keys::EtcdLockKeys::lock_directory("lockingkit/", &key);
    let mut client = cluster.client().await;
    let before = client
        .get("x", None)
        .await
        .expect("get")
        .header()
        .map(|h| h.revision())
        .unwrap_or(0);
    let followers: Vec<usize> = (0..3).filter(|m| *m != leader).collect();
    for follower in &followers {
        cluster.pause(*follower);
    }
    let attempt = locks.try_acquire(&key).await;
    let error = attempt.expect_err("no quorum to commit the attempt");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    for follower in &followers {
        cluster.resume(*follower);
    }
    cluster.until_serving().await;
    let mut history = client
        .watch(
            directory.clone(),
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(before + 1),
            ),
        )
        .await
        .expect("watch");
    // The write applied once the followers were back (the leader's log, the longest, wins the
    // next election), and the background deletes removed it: well before the 60 s lease would
    // have (their retries back off while the cluster recovers, so allow them 40 s).
    let seen = tokio::time::timeout(Duration::from_secs(40), async {
        let (mut put, mut deleted) = (false, false);
        while !(put && deleted) {
            let Ok(Some(response)) = history.message().await else {
                break;
            };
            for event in response.events() {
                match event.event_type() {
                    etcd_client::EventType::Put => put = true,
                    etcd_client::EventType::Delete => deleted = true,
                }
            }
        }
        (put, deleted)
    })
    .await;
    assert_eq!(
        seen,
        Ok((true, true)),
        "(written, deleted): the key the timed-out attempt wrote was left for the lease"
    );
    assert_eq!(cluster.count(&directory).await, 0);
    warm.release().await.expect("release");
}

/// The holder's line to the cluster is blackholed: its renewals go unanswered, so it declares
/// the lock lost at its deadline (90% of the TTL after the last renewal that was answered was
/// sent), before etcd can expire the lease and hand the key to anyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackholed_holder_is_lost_at_its_deadline_before_anyone_else_holds() {
    let cluster = EtcdCluster::single().await;
    let line = FaultProxy::to_port(port_of(&cluster.endpoint(0))).await;
    let ttl = Duration::from_secs(6);
    let holder = lock_on(EtcdOptions {
        endpoints: vec![format!("http://127.0.0.1:{}", line.port())],
        ..cluster.options(ttl)
    });
    let other = lock_on(cluster.options(ttl));
    let key = unique_prefix("blackholed");
    let held = holder.try_acquire(&key).await.expect("lock");
    // Past the first renewal, so the deadline counts from a renewal, not the acquire.
    let renewed = Instant::now() + ttl;
    while backend(&holder).keep_alives_sent() == 0 {
        assert!(Instant::now() < renewed, "no renewal within a TTL");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    line.set_fault(Fault::Blackhole);
    let cut = Instant::now();
    let taken = {
        let (other, key) = (other.clone(), key.clone());
        tokio::spawn(async move {
            let handle = other.acquire(&key, Duration::from_secs(30)).await;
            (handle, Instant::now())
        })
    };
    tokio::time::timeout(ttl * 2, held.lost_token().cancelled())
        .await
        .expect("lost within two TTLs");
    let lost = Instant::now();
    assert_eq!(held.loss_reason(), Some(lockingkit::LossReason::Deadline));
    // The last answered renewal was sent at most a renewal interval (a third of the TTL)
    // before the cut, and no later than the cut.
    let deadline = ttl * 9 / 10;
    let after_cut = lost - cut;
    assert!(
        after_cut >= deadline - ttl / 3 - Duration::from_millis(200)
            && after_cut <= deadline + Duration::from_millis(500),
        "lost {after_cut:?} after the cut, for a deadline of {deadline:?} after the last renewal"
    );
    let (next, at) = taken.await.expect("task");
    let next = next.expect("the key once the lease expired");
    assert!(
        at > lost,
        "another process held the key before the holder gave it up"
    );
    next.release().await.expect("release");
}

/// An operator revokes the backend's lease: every hold on it is lost at once (the holds'
/// watches see their keys deleted), and the keys are free for others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_the_backends_lease_loses_every_hold_at_once() {
    let cluster = EtcdCluster::single().await;
    let locks = lock_on(cluster.options(Duration::from_secs(30)));
    let prefix = unique_prefix("revoked");
    let mut holds = Vec::new();
    for i in 0..3 {
        holds.push(
            locks
                .try_acquire(&format!("{prefix}/{i}"))
                .await
                .expect("lock"),
        );
    }
    let watched = Instant::now() + Duration::from_secs(5);
    while backend(&locks).watches() < 3 {
        assert!(Instant::now() < watched, "the holds are not watched");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let lease = backend(&locks).lease_id().expect("a lease");
    let mut client = cluster.client().await;
    let revoked = Instant::now();
    client.lease_revoke(lease).await.expect("revoke");
    for hold in &holds {
        tokio::time::timeout(Duration::from_secs(1), hold.lost_token().cancelled())
            .await
            .expect("loss at once, not at the next renewal ten seconds on");
        assert_eq!(hold.loss_reason(), Some(lockingkit::LossReason::LeaseGone));
    }
    assert!(revoked.elapsed() < Duration::from_secs(1));
    let other = lock_on(cluster.options(Duration::from_secs(30)));
    let next = other
        .try_acquire(&format!("{prefix}/0"))
        .await
        .expect("free at once");
    assert!(next.fencing_token() > holds[0].fencing_token());
    next.release().await.expect("release");
}
