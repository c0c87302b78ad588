//! Faults injected into real etcd clusters: the leader killed under a hundred holds, quorum
//! lost, the whole cluster restarted, a holder's key taken away by another client, and holder
//! processes killed or paused (SIGSTOP) past their lease.
//!
//! Holder processes are this test binary run again as a child (`holder_process`, ignored
//! unless the parent sets `LOCKINGKIT_ETCD_HOLDER`): it takes the lock, says so on stdout, and
//! says so again if it finds the lock lost.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Stdio};
use std::time::Duration;

use lockingkit::testing::{quick_polling, unique_prefix};
use lockingkit::{DistributedLock, ErrorKind, EtcdBackend, EtcdOptions};
use lockingkit_tests::chaos::acquire_through_outages;
use lockingkit_tests::checks::assert_token_grew;
use lockingkit_tests::etcd::EtcdCluster;
use lockingkit_tests::os::this_test_again;
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
    // The engine saw the outage: a call while it still counts etcd as failing is refused at
    // once, and the next one after its probe goes through.
    let (again, _) = acquire_through_outages(&other, &key, ttl * 4)
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
    assert_token_grew(held, before, "a restart of every member").await;
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
        lockingkit_tests::os::signal(self.0.id(), signal);
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

/// Starts this binary again as a holder of `key` on the cluster's first member.
fn spawn_holder(
    cluster: &EtcdCluster,
    key: &str,
    ttl: Duration,
) -> (Holder, BufReader<ChildStdout>) {
    spawn_holder_at(&[cluster.endpoint(0)], key, ttl)
}

/// Starts this binary again as a holder of `key`, reaching the cluster at `endpoints`.
fn spawn_holder_at(
    endpoints: &[String],
    key: &str,
    ttl: Duration,
) -> (Holder, BufReader<ChildStdout>) {
    let mut child = this_test_again(module_path!(), "holder_process")
        .args(["--test-threads", "1"])
        .env(
            HOLDER_ENV,
            format!("{}|{key}|{}", endpoints.join(","), ttl.as_secs()),
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
    let (Some(endpoints), Some(key), Some(ttl)) = (parts.next(), parts.next(), parts.next()) else {
        return;
    };
    let ttl = Duration::from_secs(ttl.parse().expect("ttl"));
    let options = EtcdOptions::new(endpoints.split(','))
        .with_lease_ttl(ttl)
        .with_request_timeout((ttl / 3).min(Duration::from_secs(2)));
    let locks = lock_on(options);
    let held = locks.try_acquire(key).await.expect("the holder's lock");
    println!("HELD {}", held.fencing_token());
    held.lost_token().cancelled().await;
    println!("LOST {:?}", held.loss_reason());
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
    // That attempt may have been written to the connection the member had before it died (the
    // client had not yet seen it close): its key is then a key that may have been written, for
    // the background deletes. The waits below are refused without a request.
    let strays = backend(&locks).pending_deletes();
    assert!(strays <= 1, "{strays} deletes pending after one attempt");
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
        strays,
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
    let locks = lock_on(
        cluster
            .options(Duration::from_secs(6))
            .with_endpoints(vec![format!("http://127.0.0.1:{}", line.port())]),
    );
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
    let options = cluster
        .options(Duration::from_secs(6))
        .with_endpoints(vec![format!("http://127.0.0.1:{}", line.port())]);
    let locks = DistributedLock::builder(EtcdBackend::new(options).expect("options"))
        .options(quick_polling().with_release_timeout(Duration::from_millis(200)))
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
    let options = cluster
        .options(Duration::from_secs(60))
        .with_endpoints(vec![cluster.endpoint(leader)])
        .with_lease_ttl(Duration::from_secs(60))
        .with_request_timeout(Duration::from_secs(15));
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
    let holder = lock_on(
        cluster
            .options(ttl)
            .with_endpoints(vec![format!("http://127.0.0.1:{}", line.port())]),
    );
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

/// Where the history is compacted, counted from the revision of the change (a delete or an
/// overwrite) that took the holder's key away.
#[derive(Clone, Copy, Debug)]
enum Compaction {
    /// At the change itself. A delete's tombstone goes with the history before it, and a watch
    /// that starts at the delete's revision is not cancelled, so it never hears of the delete.
    AtTheChange,
    /// One revision past the change: a watch from the change's revision is cancelled.
    OnePast,
    /// Fifty revisions past it.
    FarPast,
}

impl Compaction {
    const ALL: [Compaction; 3] = [
        Compaction::AtTheChange,
        Compaction::OnePast,
        Compaction::FarPast,
    ];

    fn writes_after_the_change(self) -> usize {
        match self {
            Compaction::AtTheChange => 0,
            Compaction::OnePast => 1,
            Compaction::FarPast => 50,
        }
    }
}

/// How soon a holder whose key was taken away while its watch could not hear it must say it
/// lost, once it can hear again: the watch stream reopens after a backoff of 50 ms doubling
/// (a member that refuses is passed over at once), its watches are created again, and a hold
/// whose history is gone reads its key. The next renewal is ten seconds away.
const LOSS_BOUND: Duration = Duration::from_secs(3);

/// A holder's lines to the cluster, one fault proxy per member, in member order.
struct Lines(Vec<FaultProxy>);

impl Lines {
    async fn to(cluster: &EtcdCluster) -> Lines {
        let mut lines = Vec::new();
        for index in 0..cluster.size() {
            lines.push(FaultProxy::to_port(port_of(&cluster.endpoint(index))).await);
        }
        Lines(lines)
    }

    fn endpoints(&self) -> Vec<String> {
        self.0
            .iter()
            .map(|line| format!("http://127.0.0.1:{}", line.port()))
            .collect()
    }

    /// The member the holder talks to: a backend sends everything to one member while it
    /// answers. The connections of the case before (its holder shut down, its member killed)
    /// may take a moment to close on a loaded machine, so this waits until one line alone
    /// has connections open.
    async fn in_use(&self) -> usize {
        let give_up = Instant::now() + Duration::from_secs(10);
        loop {
            let open: Vec<usize> = (0..self.0.len())
                .filter(|&index| self.0[index].connections_open() > 0)
                .collect();
            if let [member] = open.as_slice() {
                return *member;
            }
            assert!(
                Instant::now() < give_up,
                "the holder talks to one member: {open:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn set_fault(&self, fault: Fault) {
        for line in &self.0 {
            line.set_fault(fault);
        }
    }
}

/// Waits until member `index` itself serves a watcher: the holder's watch is live there.
async fn until_watched_at(cluster: &EtcdCluster, index: usize) {
    let give_up = Instant::now() + Duration::from_secs(10);
    while cluster.watchers(index).await == 0 {
        assert!(Instant::now() < give_up, "member {index} serves no watch");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The holder's key of the lock `key` (the only key in its directory) and its create revision.
async fn holder_key(client: &mut etcd_client::Client, key: &str) -> (Vec<u8>, i64) {
    let directory = lockingkit::keys::EtcdLockKeys::lock_directory("lockingkit/", key);
    let found = client
        .get(
            directory,
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("get");
    assert_eq!(found.kvs().len(), 1, "one holder, nobody queued");
    let kv = &found.kvs()[0];
    (kv.key().to_vec(), kv.create_revision())
}

/// How another client takes the holder's key away.
#[derive(Clone, Copy, Debug)]
enum Taken {
    Deleted,
    Overwritten,
}

/// Takes the holder's key away through `client` as the first write since the key was created,
/// then compacts the history as `compaction` says, physically: the member no longer has the
/// history when it answers.
///
/// The cluster has just lost a member, and on a loaded machine it may still be electing a
/// leader: a write can come back `Unavailable` ("request timed out") whether or not it was
/// applied. Each write is read back before it is tried again, so none is applied twice and the
/// revisions the case asserts on are the ones the writes made.
async fn take_and_compact(
    client: &mut etcd_client::Client,
    key: &[u8],
    created: i64,
    taken: Taken,
    compaction: Compaction,
) {
    let taken_at = take(client, key, created, taken).await;
    assert_eq!(
        taken_at,
        created + 1,
        "the key is taken by the first write after the acquire"
    );
    let mut compact_at = taken_at;
    for i in 0..compaction.writes_after_the_change() {
        // Unique values: a read-back must not find an earlier case's filler.
        compact_at = put_once(client, b"chaos-filler", &format!("{created}/{i}")).await;
    }
    let give_up = Instant::now() + CLUSTER_PATIENCE;
    loop {
        let options = etcd_client::CompactionOptions::new().with_physical();
        match client.compact(compact_at, Some(options)).await {
            Ok(_) => return,
            // An earlier try that timed out compacted it after all.
            Err(error) if error.to_string().contains("compacted") => return,
            Err(error) => patience_left(give_up, "compact", &error).await,
        }
    }
}

/// How long the test's own writes may be refused by a cluster that is electing a leader.
const CLUSTER_PATIENCE: Duration = Duration::from_secs(30);

/// Fails the case once `give_up` has passed, else pauses before the next try.
async fn patience_left(give_up: Instant, what: &str, error: &etcd_client::Error) {
    assert!(Instant::now() < give_up, "{what}: {error}");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Deletes or overwrites `key` once, and returns the revision of that change.
async fn take(client: &mut etcd_client::Client, key: &[u8], created: i64, taken: Taken) -> i64 {
    let give_up = Instant::now() + CLUSTER_PATIENCE;
    loop {
        let written = match taken {
            Taken::Deleted => client.delete(key, None).await.map(|mut r| r.take_header()),
            Taken::Overwritten => client
                .put(key, "someone else", None)
                .await
                .map(|mut r| r.take_header()),
        };
        let error = match written {
            Ok(header) => return header.expect("a header").revision(),
            Err(error) => error,
        };
        // Did the write that failed happen? Then the key's first change since `created` is it.
        if let Ok(found) = client.get(key, None).await {
            let done = match taken {
                Taken::Deleted => found.kvs().is_empty(),
                Taken::Overwritten => found
                    .kvs()
                    .first()
                    .is_some_and(|kv| kv.value() == b"someone else"),
            };
            if done {
                return first_change_after(client, key, created).await;
            }
        }
        patience_left(give_up, "take the key", &error).await;
    }
}

/// The revision of the first change of `key` after revision `created`, from its history.
async fn first_change_after(client: &mut etcd_client::Client, key: &[u8], created: i64) -> i64 {
    let options = etcd_client::WatchOptions::new().with_start_revision(created + 1);
    let mut stream = client.watch(key, Some(options)).await.expect("watch");
    loop {
        let message = stream.message().await.expect("a watch message");
        let answer = message.expect("the watch stays open");
        if let Some(kv) = answer.events().first().and_then(|event| event.kv()) {
            return kv.mod_revision();
        }
    }
}

/// Puts `value` at `key` once, and returns the revision of that write.
async fn put_once(client: &mut etcd_client::Client, key: &[u8], value: &str) -> i64 {
    let give_up = Instant::now() + CLUSTER_PATIENCE;
    loop {
        let error = match client.put(key, value, None).await {
            Ok(put) => return put.header().expect("a header").revision(),
            Err(error) => error,
        };
        if let Ok(found) = client.get(key, None).await {
            if let Some(kv) = found
                .kvs()
                .first()
                .filter(|kv| kv.value() == value.as_bytes())
            {
                return kv.mod_revision();
            }
        }
        patience_left(give_up, "put", &error).await;
    }
}

/// Kills the member the holder talks to and deletes or overwrites its key through another,
/// compacting the history at, one past or far past that write, while the holder cannot hear it
/// (its lines blackholed, as for a paused process), or after its watch moved to another
/// member. Whenever it can hear again, the holder is told it lost — `LeaseGone`, within a few
/// hundred milliseconds, not at its next renewal (or never) — and the key is free for another
/// process (an overwritten key is deleted by the lost hold's clean-up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holders_key_taken_while_its_member_is_down_is_loss_whatever_the_compaction() {
    let mut cluster = EtcdCluster::three().await;
    let lines = Lines::to(&cluster).await;
    let ttl = Duration::from_secs(30);
    let cases = [true, false].into_iter().flat_map(|cut_off| {
        [Taken::Deleted, Taken::Overwritten]
            .into_iter()
            .flat_map(move |taken| Compaction::ALL.map(|compaction| (cut_off, taken, compaction)))
    });
    for (cut_off, taken, compaction) in cases {
        let case = format!("cut off: {cut_off}, {taken:?}, compacted {compaction:?}");
        let locks = lock_on(cluster.options(ttl).with_endpoints(lines.endpoints()));
        let key = unique_prefix("compacted");
        let held = locks.try_acquire(&key).await.expect("lock");
        let member = lines.in_use().await;
        until_watched_at(&cluster, member).await;
        let elsewhere = (member + 1) % cluster.size();
        let mut other = cluster.client_of(elsewhere).await;
        let (holder_key, created) = holder_key(&mut other, &key).await;
        if cut_off {
            lines.set_fault(Fault::Blackhole);
        }
        cluster.kill(member);
        // It may have led: the delete goes to the next leader.
        cluster.leader().await;
        if !cut_off {
            // The hold's watch moves to a member that still runs before anything happens.
            let moved = Instant::now() + Duration::from_secs(10);
            while cluster.watchers(elsewhere).await == 0
                && cluster.watchers((member + 2) % cluster.size()).await == 0
            {
                assert!(Instant::now() < moved, "{case}: the watch did not move");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        // From when the holder can hear again: at once if its watch moved, else once its
        // lines pass.
        let mut heard = Instant::now();
        take_and_compact(&mut other, &holder_key, created, taken, compaction).await;
        if cut_off {
            heard = Instant::now();
            lines.set_fault(Fault::Pass);
        }
        let lost = tokio::time::timeout(LOSS_BOUND, held.lost_token().cancelled()).await;
        let after = heard.elapsed();
        eprintln!("{case}: lost after {after:?}");
        assert!(lost.is_ok(), "{case}: still held {after:?} later");
        assert_eq!(
            held.loss_reason(),
            Some(lockingkit::LossReason::LeaseGone),
            "{case}"
        );
        // An overwritten key is on no lease any more: only the lost hold's release frees it.
        let next = lock_on(cluster.options(ttl))
            .acquire(&key, Duration::from_secs(5))
            .await
            .expect("the key is free");
        assert!(next.fencing_token() > held.fencing_token());
        assert!(!held.is_held());
        next.release().await.expect("release");
        drop(held);
        locks
            .shutdown(Duration::from_secs(5))
            .await
            .expect("shutdown");
        cluster.restart(member).await;
        cluster.until_serving().await;
    }
}

/// The scenario as another program saw it: a holder process is paused (SIGSTOP), its member is
/// killed, its key deleted through another member and the history compacted at, one past or far
/// past the delete; the holder resumes. It reports the loss within the bound, whatever the
/// compaction, while another process takes the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_holder_whose_key_was_deleted_and_compacted_away_reports_the_loss() {
    let mut cluster = EtcdCluster::three().await;
    let lines = Lines::to(&cluster).await;
    let ttl = Duration::from_secs(30);
    for compaction in Compaction::ALL {
        let key = unique_prefix("paused-compacted");
        let (child, output) = spawn_holder_at(&lines.endpoints(), &key, ttl);
        let mut output = output_lines(output);
        let token: u64 = line_within(&mut output, "HELD", Duration::from_secs(10))
            .await
            .expect("the holder holds")
            .parse()
            .expect("a token");
        let member = lines.in_use().await;
        until_watched_at(&cluster, member).await;
        let elsewhere = (member + 1) % cluster.size();
        let mut other = cluster.client_of(elsewhere).await;
        let (holder_key, created) = holder_key(&mut other, &key).await;
        assert_eq!(u64::try_from(created).ok(), Some(token));
        child.signal(libc::SIGSTOP);
        cluster.kill(member);
        // It may have led: the delete goes to the next leader.
        cluster.leader().await;
        take_and_compact(&mut other, &holder_key, created, Taken::Deleted, compaction).await;
        let resumed = Instant::now();
        child.signal(libc::SIGCONT);
        let next = lock_on(cluster.options(ttl))
            .try_acquire(&key)
            .await
            .expect("the key is free");
        let lost = line_within(&mut output, "LOST", LOSS_BOUND).await;
        let after = resumed.elapsed();
        eprintln!("paused, compacted {compaction:?}: lost after {after:?}");
        assert_eq!(
            lost.as_deref(),
            Some("Some(LeaseGone)"),
            "compacted {compaction:?}: the resumed holder did not report the loss within {LOSS_BOUND:?}"
        );
        assert!(next.fencing_token() > token);
        next.release().await.expect("release");
        drop(child);
        cluster.restart(member).await;
        cluster.until_serving().await;
    }
}

/// A holder's output, line by line, read on a thread of its own so that a test can wait for a
/// line with a timeout.
fn output_lines(lines: BufReader<ChildStdout>) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (send, receive) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in lines.lines() {
            let Ok(line) = line else { return };
            if send.send(line).is_err() {
                return;
            }
        }
    });
    receive
}

/// What follows `word` on the next line that says it, if one comes within `within`.
async fn line_within(
    output: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    word: &str,
    within: Duration,
) -> Option<String> {
    let found = tokio::time::timeout(within, async {
        while let Some(line) = output.recv().await {
            // libtest writes `test holder_process ... ` before the test's own output.
            if let Some((_, rest)) = line.split_once(word) {
                return Some(rest.trim().to_owned());
            }
        }
        None
    });
    found.await.ok().flatten()
}
