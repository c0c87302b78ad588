//! The Redis chaos suite: faults injected into real Redis servers, each case with its expected
//! outcome.
//!
//! | fault | expected |
//! |---|---|
//! | server killed and restarted without persistence | every holder lost at its next renewal (`LeaseGone`), tokens still grow |
//! | server frozen (SIGSTOP) past the deadline, thawed within the lease | loss at the deadline; the key free after the loss, at the latest one lease after the server woke |
//! | server frozen past the lease | loss at the deadline; the key free as soon as the server wakes; the renewals that queued up find it gone, the lost lease's renewal is `LeaseGone`, and the next holder keeps it |
//! | holder's connections reset until a renewal failed on them | transient: reconnected, no loss, the lock stays held |
//! | holder's line blackholed for less than the deadline | transient: no loss, renewals resume |
//! | holder's line blackholed past the deadline | loss at the deadline; the key free only once its lease ran out |
//! | `FLUSHALL`, or the key deleted by another client | `LeaseGone` at the next renewal |
//! | another client overwrites the key (same type or another) | `LeaseGone` at the next renewal |
//! | a replica without the lock promoted after the primary died | the holder loses it at its next renewal; tokens still grow |
//! | the same with `replicas = 1` | the acquire is refused while the replica cannot acknowledge; once it can, the lock survives the failover |
//! | the holder's process killed | the key free once its lease ran out, not before |
//!
//! Every "process" (a `DistributedLock` with its own backend) reaches the server through a
//! [`FaultProxy`] of its own, so a network fault hits one process only. The engine's loss
//! deadline runs from the instant it *sent* its last successful renewal; the proxy sees when
//! each request arrived and whether it was answered, which bounds that instant from outside
//! ([`FaultProxy::last_answered_request`], at most [`SEND_SKEW`] after the send).

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use lockingkit::keys::RedisLockKeys;
use lockingkit::testing::{quick_polling, unique_prefix, IntervalChecker};
use lockingkit::{DistributedLock, ErrorKind, LossReason, RedisBackend, RedisOptions};
use lockingkit_tests::chaos::{
    self, assert_lost, assert_near, contender_lock, record, Watched, PATIENCE,
};
use lockingkit_tests::checks::assert_token_grew;
use lockingkit_tests::os::this_test_again;
use lockingkit_tests::proxy::{Fault, FaultProxy};
use lockingkit_tests::redis::RedisServer;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::reader::MetricReader;
use opentelemetry_sdk::metrics::{
    InstrumentKind, ManualReader, Pipeline, SdkMeterProvider, Temporality,
};
use tokio::time::Instant;

/// The lease: short, so each case takes seconds. Renewed every second.
const LEASE: Duration = Duration::from_secs(3);
const RENEW_EVERY: Duration = Duration::from_secs(1);
/// At most a third of the lease.
const REQUEST_TIMEOUT: Duration = Duration::from_millis(500);
/// How much earlier than the proxy read it the engine may have sent a request (the client's own
/// pipeline, a loaded 2-core machine).
const SEND_SKEW: Duration = Duration::from_millis(300);
/// How late after its expected instant a loss may be observed on a loaded machine. Below the
/// 300 ms between the deadline (90% of the lease) and the lease's end, the bound that matters.
const LATE: Duration = Duration::from_millis(250);

fn options_for(port: u16) -> RedisOptions {
    RedisOptions::new(format!("redis://127.0.0.1:{port}"))
        .with_lease_duration(LEASE)
        .with_request_timeout(REQUEST_TIMEOUT)
}

fn lock_on(options: RedisOptions) -> DistributedLock {
    DistributedLock::builder(RedisBackend::new(options).expect("valid Redis options"))
        .options(quick_polling())
        .build()
        .expect("valid lock options")
}

/// A process's own metrics pipeline, read on demand: what its engine counted as
/// `lockingkit.renewals` shows whether a renewal failed.
struct Renewals {
    reader: SharedReader,
    provider: SdkMeterProvider,
}

/// The manual reader, shared by the meter provider (which owns a reader) and the test.
#[derive(Clone, Debug)]
struct SharedReader(Arc<ManualReader>);

impl MetricReader for SharedReader {
    fn register_pipeline(&self, pipeline: std::sync::Weak<Pipeline>) {
        self.0.register_pipeline(pipeline)
    }
    fn collect(&self, rm: &mut ResourceMetrics) -> OTelSdkResult {
        self.0.collect(rm)
    }
    fn force_flush(&self) -> OTelSdkResult {
        self.0.force_flush()
    }
    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.0.shutdown_with_timeout(timeout)
    }
    fn temporality(&self, kind: InstrumentKind) -> Temporality {
        self.0.temporality(kind)
    }
}

impl Renewals {
    fn new() -> Renewals {
        let reader = SharedReader(Arc::new(ManualReader::builder().build()));
        let provider = SdkMeterProvider::builder()
            .with_reader(reader.clone())
            .build();
        Renewals { reader, provider }
    }

    fn meter(&self) -> opentelemetry::metrics::Meter {
        lockingkit::telemetry::meter(&self.provider)
    }

    /// How many renewals failed so far (retried, or ending in loss).
    fn failed(&self) -> u64 {
        let mut metrics = ResourceMetrics::default();
        self.reader.collect(&mut metrics).expect("collect");
        let mut failed = 0;
        for metric in metrics.scope_metrics().flat_map(|scope| scope.metrics()) {
            let AggregatedMetrics::U64(MetricData::Sum(sum)) = metric.data() else {
                continue;
            };
            if metric.name() != "lockingkit.renewals" {
                continue;
            }
            failed += sum
                .data_points()
                .filter(|point| {
                    point.attributes().any(|kv| {
                        kv.key.as_str() == "lockingkit.outcome" && kv.value.as_str() == "failed"
                    })
                })
                .map(|point| point.value())
                .sum::<u64>();
        }
        failed
    }
}

/// A chaos [`Process`](chaos::Process) that also reads its own engine's renewal counts.
struct Process {
    process: chaos::Process,
    renewals: Renewals,
}

impl std::ops::Deref for Process {
    type Target = chaos::Process;

    fn deref(&self) -> &chaos::Process {
        &self.process
    }
}

impl Process {
    async fn on(server: &RedisServer, id: usize) -> Process {
        Self::through(FaultProxy::to_port(server.port()).await, id, |o| o)
    }

    fn through(
        proxy: FaultProxy,
        id: usize,
        tune: impl FnOnce(RedisOptions) -> RedisOptions,
    ) -> Process {
        let renewals = Renewals::new();
        let backend = RedisBackend::new(tune(options_for(proxy.port()))).expect("valid options");
        let locks = DistributedLock::builder(backend)
            .options(quick_polling())
            .meter(renewals.meter())
            .build()
            .expect("valid lock options");
        Process {
            process: chaos::Process { id, proxy, locks },
            renewals,
        }
    }

    /// Waits until the hold has reached a steady state: its second renewal was answered, so the
    /// loss a case provokes is measured from a renewal. (The first may be two requests: the
    /// server answers "no such script" to the script's SHA, and it is then sent whole.)
    async fn settle(&self, watched: &Watched) {
        self.answered_after(watched.acquired + RENEW_EVERY + RENEW_EVERY / 2)
            .await;
    }
}

// ----------------------------------------------------------------------------------------------
// The server killed, frozen, flushed; the key deleted or overwritten
// ----------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restarted_without_persistence_loses_every_holder_at_its_next_renewal() {
    let mut server = RedisServer::start().await;
    let checker = IntervalChecker::new();
    let (holder, other) = (Process::on(&server, 0).await, Process::on(&server, 1).await);
    let keys = [
        unique_prefix("chaos/restart/a"),
        unique_prefix("chaos/restart/b"),
    ];
    let mut watched = Vec::new();
    for key in &keys {
        watched.push(holder.hold_watched(key).await);
    }
    let highest = watched.iter().map(|w| w.token).max().unwrap_or(0);
    holder.answered_after(Instant::now()).await;
    server.kill();
    let killed = Instant::now();
    server.start_again().await;
    let restarted = Instant::now();
    for (key, hold) in keys.iter().zip(watched) {
        let (loss, hold) = hold.lost_within(PATIENCE).await;
        // The next renewal that reaches the new, empty server finds the key gone: never before
        // the kill (a renewal may reach the new server before this test sees it up), and once
        // the server is back, within a renewal interval and a probe of the connection backoff
        // (which may have grown while the server was down).
        assert_lost(&loss, LossReason::LeaseGone);
        assert!(loss.at > killed, "lost before the server died");
        assert_near(
            "loss",
            loss.at,
            restarted,
            restarted - killed,
            RENEW_EVERY + Duration::from_secs(2),
        );
        assert_eq!(&hold.key, key);
        checker.record(hold);
    }
    for key in &keys {
        other.usable_again(key, &checker, highest).await;
    }
    checker.assert_consistent();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_is_loss_at_the_deadline_and_frees_the_key_after_the_loss() {
    let mut server = RedisServer::start().await;
    let checker = IntervalChecker::new();
    let key = unique_prefix("chaos/sigstop");
    let (holder, other) = (Process::on(&server, 0).await, Process::on(&server, 1).await);
    let watched = holder.hold_watched(&key).await;
    holder.settle(&watched).await;
    let token = watched.token;
    server.pause();
    let paused = Instant::now();
    let (loss, hold) = watched.lost_within(PATIENCE).await;
    let last = holder.proxy.last_answered_request().expect("a renewal");
    assert!(last < paused);
    assert_lost(&loss, LossReason::Deadline);
    assert_near("loss", loss.at, last + LEASE * 9 / 10, SEND_SKEW, LATE);
    checker.record(hold);
    // Thawed before the lease ran out. The holder's engine gave the lock up after declaring
    // loss, and the server runs that release once it wakes, so the key is usually free at once
    // (after the loss: the checker below sees no overlap). At the latest it is free one lease
    // after the server woke: renewals that timed out while it slept still run when it wakes,
    // and one of them may extend the lease if the release did not reach it.
    server.resume();
    let resumed = Instant::now();
    let contender = other.wait_for(&key);
    let (handle, start) = contender_lock(contender).await;
    assert!(
        start > loss.at,
        "the key was taken before the holder knew it lost it"
    );
    assert!(
        start <= resumed + LEASE + Duration::from_secs(1),
        "the key stayed taken {:?} after the server woke",
        start - resumed
    );
    assert!(handle.fencing_token() > token);
    record(&checker, &key, other.id, handle.fencing_token(), start);
    handle.release().await.expect("release");
    holder.usable_again(&key, &checker, token).await;
    checker.assert_consistent();
}

/// Frozen for longer than the lease: the holder declares loss at its deadline; once the server
/// wakes, the key is free at once (its lease ran out by the server's clock, which went on), the
/// renewals and the release that queued up while it slept find it gone and bring nothing back,
/// and a new holder keeps it undisturbed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_frozen_past_the_lease_frees_the_key_and_late_renewals_never_bring_it_back() {
    let mut server = RedisServer::start().await;
    let checker = IntervalChecker::new();
    let key = unique_prefix("chaos/sigstop-past");
    let name = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).lock;
    let (holder, other) = (Process::on(&server, 0).await, Process::on(&server, 1).await);
    let watched = holder.hold_watched(&key).await;
    holder.settle(&watched).await;
    let token = watched.token;
    let failed_before = holder.renewals.failed();
    server.pause();
    let paused = Instant::now();
    let (loss, hold) = watched.lost_within(PATIENCE).await;
    let last = holder.proxy.last_answered_request().expect("a renewal");
    assert!(last < paused);
    assert_lost(&loss, LossReason::Deadline);
    assert_near("loss", loss.at, last + LEASE * 9 / 10, SEND_SKEW, LATE);
    assert!(
        holder.renewals.failed() > failed_before,
        "renewals were sent into the frozen server"
    );
    checker.record(hold);
    // Thawed well after the lease ran out.
    tokio::time::sleep_until(last + LEASE + Duration::from_millis(1500)).await;
    server.resume();
    let resumed = Instant::now();
    assert_eq!(
        server.cli(&["EXISTS", &name]),
        "0",
        "free once the server wakes"
    );
    let (handle, start) = other.acquire(&key).await;
    assert!(
        start - resumed < Duration::from_secs(1),
        "taken {:?} after the server woke",
        start - resumed
    );
    assert!(handle.fencing_token() > token);
    // The lost holder's renewal now answers that the lease is gone, and the new holder keeps the
    // key through more than a lease of its own renewals.
    let lease = loss
        .handle
        .lease::<lockingkit::providers::redis::RedisLease>()
        .expect("a Redis lease");
    let backend = holder
        .locks
        .backend::<RedisBackend>()
        .expect("a Redis backend");
    let late = lockingkit::backend::LockBackend::renew(backend, lease)
        .await
        .expect_err("the lost lease is gone");
    assert_eq!(
        late.kind(),
        lockingkit::backend::BackendErrorKind::LeaseGone,
        "{late}"
    );
    let mut kept = Watched::new(other.id, handle, start);
    kept.still_held_after(LEASE + RENEW_EVERY).await;
    let holder_id = server.cli(&["GET", &name]);
    assert_ne!(
        holder_id,
        lease.holder_id(),
        "the lost holder's id never came back"
    );
    record(&checker, &key, other.id, token + 1, start);
    kept.end().await;
    checker.assert_consistent();
}

/// Another client removes or replaces the lock's key: the holder's next renewal says the lease
/// is gone, within one renewal interval.
async fn key_taken_away(what: &[&str]) {
    let server = RedisServer::start().await;
    let key = unique_prefix("chaos/taken-away");
    let name = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).lock;
    let holder = Process::on(&server, 0).await;
    let watched = holder.hold_watched(&key).await;
    let mut args: Vec<&str> = what.to_vec();
    for arg in &mut args {
        if *arg == "{key}" {
            *arg = &name;
        }
    }
    server.cli(&args);
    let done = Instant::now();
    let (loss, _) = watched.lost_within(PATIENCE).await;
    assert_lost(&loss, LossReason::LeaseGone);
    assert_near("loss", loss.at, done, Duration::ZERO, RENEW_EVERY + LATE);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushall_is_lease_gone_at_the_next_renewal() {
    key_taken_away(&["FLUSHALL"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_deleted_by_another_client_is_lease_gone_at_the_next_renewal() {
    key_taken_away(&["DEL", "{key}"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_overwritten_by_another_client_is_lease_gone_at_the_next_renewal() {
    key_taken_away(&["SET", "{key}", "someone-else", "PX", "30000"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_overwritten_with_another_type_is_lease_gone_at_the_next_renewal() {
    key_taken_away(&[
        "EVAL",
        "redis.call('DEL', KEYS[1]); return redis.call('HSET', KEYS[1], 'f', 'v')",
        "1",
        "{key}",
    ])
    .await;
}

// ----------------------------------------------------------------------------------------------
// Network faults through the proxy
// ----------------------------------------------------------------------------------------------

/// Every connection of the holder is reset, and new ones too, until a renewal has failed on it;
/// then the line heals. The failure is transient: a retry reconnects and renews before the
/// deadline, and the lock is never lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_connection_is_transient_and_the_lock_stays_held() {
    let server = RedisServer::start().await;
    let key = unique_prefix("chaos/reset");
    let (holder, other) = (Process::on(&server, 0).await, Process::on(&server, 1).await);
    let mut watched = holder.hold_watched(&key).await;
    holder.settle(&watched).await;
    let (before, failed_before) = (
        holder.proxy.connections_accepted(),
        holder.renewals.failed(),
    );
    holder.proxy.set_fault(Fault::Reset);
    let reset = Instant::now();
    // Kept until a renewal met it (the next is due within a second).
    while holder.renewals.failed() == failed_before {
        assert!(
            reset.elapsed() < Duration::from_secs(5),
            "no renewal was tried during the reset"
        );
        watched.still_held_after(Duration::from_millis(10)).await;
    }
    holder.proxy.set_fault(Fault::Pass);
    let healed = Instant::now();
    eprintln!("reset for {:?}", healed - reset);
    holder.answered_after(healed).await;
    assert!(
        holder.proxy.connections_accepted() > before,
        "the holder reconnected"
    );
    // Held through two more leases, and busy for everyone else meanwhile.
    for _ in 0..4 {
        watched.still_held_after(LEASE / 2).await;
        let error = other.locks.try_acquire(&key).await.expect_err("held");
        assert_eq!(error.kind(), ErrorKind::Busy, "{error}");
    }
    watched.end().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_blackholed_for_less_than_the_deadline_is_transient() {
    let server = RedisServer::start().await;
    let key = unique_prefix("chaos/short-blackhole");
    let (holder, other) = (Process::on(&server, 0).await, Process::on(&server, 1).await);
    let mut watched = holder.hold_watched(&key).await;
    holder.settle(&watched).await;
    let last = holder.proxy.last_answered_request().expect("a renewal");
    holder.proxy.set_fault(Fault::Blackhole);
    // Healed with over half a second to spare before the deadline (2.7 s after `last`).
    tokio::time::sleep_until(last + Duration::from_millis(1800)).await;
    holder.proxy.set_fault(Fault::Pass);
    let healed = Instant::now();
    holder.answered_after(healed).await;
    for _ in 0..4 {
        watched.still_held_after(LEASE / 2).await;
        let error = other.locks.try_acquire(&key).await.expect_err("held");
        assert_eq!(error.kind(), ErrorKind::Busy, "{error}");
    }
    watched.end().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_blackholed_past_the_deadline_is_loss_on_time_and_the_key_frees_after_the_lease() {
    let server = RedisServer::start().await;
    let checker = IntervalChecker::new();
    let key = unique_prefix("chaos/blackhole");
    let (holder, other) = (Process::on(&server, 0).await, Process::on(&server, 1).await);
    let watched = holder.hold_watched(&key).await;
    holder.settle(&watched).await;
    let token = watched.token;
    let contender = other.wait_for(&key);
    holder.proxy.set_fault(Fault::Blackhole);
    let (loss, hold) = watched.lost_within(PATIENCE).await;
    let last = holder.proxy.last_answered_request().expect("a renewal");
    assert_lost(&loss, LossReason::Deadline);
    assert_near("loss", loss.at, last + LEASE * 9 / 10, SEND_SKEW, LATE);
    assert!(
        loss.at < last + LEASE,
        "loss declared after the lease ran out"
    );
    checker.record(hold);
    let (handle, start) = contender_lock(contender).await;
    // The server stamps the lease when it runs the renewal, after the proxy read it; the
    // engine's release after the loss is stuck in the blackhole with everything else.
    assert!(
        start + Duration::from_millis(50) >= last + LEASE,
        "the key was free {:?} before its lease ran out",
        (last + LEASE) - start
    );
    assert!(handle.fencing_token() > token);
    record(&checker, &key, other.id, handle.fencing_token(), start);
    handle.release().await.expect("release");
    holder.proxy.set_fault(Fault::Pass);
    holder.usable_again(&key, &checker, token).await;
    checker.assert_consistent();
}

// ----------------------------------------------------------------------------------------------
// Failover: a replica promoted after the primary died
// ----------------------------------------------------------------------------------------------

/// A primary, a replica that replicates through a proxy (so replication can be cut), and a
/// service address (a proxy) that clients use and a failover points elsewhere.
struct Failover {
    primary: RedisServer,
    replica: RedisServer,
    replication: FaultProxy,
    service: Process,
    /// A replica of the promoted one, as a failover manager would attach.
    standby: Option<RedisServer>,
}

impl Failover {
    async fn start(replicas: u32) -> Failover {
        let primary = RedisServer::start().await;
        let replication = FaultProxy::to_port(primary.port()).await;
        let replica = RedisServer::replica_of(replication.port()).await;
        replica.wait_until_replicating().await;
        let service = Process::through(FaultProxy::to_port(primary.port()).await, 0, |o| {
            o.with_replicas(replicas)
                .with_replica_timeout(Duration::from_millis(200))
        });
        Failover {
            primary,
            replica,
            replication,
            service,
            standby: None,
        }
    }

    /// The primary dies, the replica is promoted, and the service address points at it; with
    /// `standby`, a new replica of the promoted one starts, so writes can be acknowledged again.
    async fn fail_over(&mut self, standby: bool) {
        self.primary.kill();
        self.replica.promote();
        self.service.proxy.set_backend(self.replica.address());
        self.service.proxy.reset_open_connections();
        if standby {
            let replica = RedisServer::replica_of(self.replica.port()).await;
            replica.wait_until_replicating().await;
            self.standby = Some(replica);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_promoted_without_the_lock_makes_the_holder_lose_it_at_its_next_renewal() {
    let mut failover = Failover::start(0).await;
    let key = unique_prefix("chaos/failover");
    // The replica stops receiving writes, so the lock taken now exists only on the primary.
    failover.replication.set_fault(Fault::Blackhole);
    let watched = failover.service.hold_watched(&key).await;
    let token = watched.token;
    failover.fail_over(false).await;
    let failed_over = Instant::now();
    let (loss, _) = watched.lost_within(PATIENCE).await;
    assert_lost(&loss, LossReason::LeaseGone);
    assert_near(
        "loss",
        loss.at,
        failed_over,
        Duration::ZERO,
        RENEW_EVERY + Duration::from_secs(1),
    );
    // The new primary never saw the counter either: its clock carries the tokens on.
    let (handle, _) = failover.service.acquire(&key).await;
    assert_token_grew(handle, token, "the new primary").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wait_for_one_replica_a_lock_is_refused_until_replicated_and_survives_the_failover() {
    let mut failover = Failover::start(1).await;
    let key = unique_prefix("chaos/failover-wait");
    let name = RedisLockKeys::lock(RedisLockKeys::DEFAULT_PREFIX, &key).lock;
    failover.replication.set_fault(Fault::Blackhole);
    let error = failover
        .service
        .locks
        .try_acquire(&key)
        .await
        .expect_err("no replica can acknowledge");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    assert!(
        error.to_string().contains("replicas acknowledged"),
        "{error}"
    );
    assert_eq!(
        failover.primary.cli(&["EXISTS", &name]),
        "0",
        "the refused lock was given back"
    );
    failover.replication.set_fault(Fault::Pass);
    failover.replica.wait_until_replicating().await;
    let mut watched = failover.service.hold_watched_after_outage(&key).await;
    failover.service.settle(&watched).await;
    let failed_over = Instant::now();
    failover.fail_over(true).await;
    // The promoted replica had the lock: renewals go on there, acknowledged by its new replica
    // (those sent before it caught up are retried), with no loss.
    failover.service.answered_after(failed_over).await;
    watched.still_held_after(LEASE).await;
    assert_eq!(failover.replica.cli(&["EXISTS", &name]), "1");
    watched.end().await;
}

// ----------------------------------------------------------------------------------------------
// A holder process that vanishes without releasing
// ----------------------------------------------------------------------------------------------

const CHILD_PORT: &str = "LOCKINGKIT_REDIS_CHAOS_CHILD_PORT";
const CHILD_KEY: &str = "LOCKINGKIT_REDIS_CHAOS_CHILD_KEY";

/// Kills the child process when dropped, so a failing case leaves nothing behind.
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_process_frees_the_key_once_its_lease_ran_out_and_not_before() {
    let server = RedisServer::start().await;
    let checker = IntervalChecker::new();
    let key = unique_prefix("chaos/vanish");
    let line = FaultProxy::to_port(server.port()).await;
    let other = Process::on(&server, 1).await;
    let mut child = this_test_again(module_path!(), "vanishing_holder_process")
        .env(CHILD_PORT, line.port().to_string())
        .env(CHILD_KEY, &key)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the holder process");
    let stdout = child.stdout.take().expect("piped stdout");
    let mut child = ChildGuard(child);
    let token = tokio::task::spawn_blocking(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|line| line.strip_prefix("HELD ")?.trim().parse::<u64>().ok())
    })
    .await
    .expect("the reading task")
    .expect("the holder process took the lock");
    // Killed just after its second renewal, so the lease it leaves runs from that renewal. (Not
    // the first: that one may be answered "no such script" and killed before it is sent whole.)
    let second_renewal = Instant::now() + RENEW_EVERY + RENEW_EVERY / 2;
    tokio::time::timeout(PATIENCE, line.exchange_after(second_renewal))
        .await
        .expect("a renewal");
    child.0.kill().expect("SIGKILL the holder");
    child.0.wait().expect("reap the holder");
    let last = line
        .exchanges()
        .last()
        .copied()
        .expect("the holder's requests");
    let (handle, start) = other.acquire(&key).await;
    // The server received the renewal between the proxy reading and answering it; the
    // contender polls at most 100 ms apart.
    assert_near(
        "the next acquire",
        start,
        last.sent + LEASE,
        Duration::from_millis(50),
        Duration::from_millis(600) + (last.answered - last.sent),
    );
    assert!(handle.fencing_token() > token);
    record(&checker, &key, other.id, handle.fencing_token(), start);
    handle.release().await.expect("release");
    checker.assert_consistent();
}

/// Not a case of its own: the holder process the vanishing-holder case starts and kills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a separate process by the vanishing-holder case"]
async fn vanishing_holder_process() {
    let (Ok(port), Ok(key)) = (std::env::var(CHILD_PORT), std::env::var(CHILD_KEY)) else {
        return;
    };
    let port = port.parse().expect("a port");
    let handle = lock_on(options_for(port))
        .acquire(&key, PATIENCE)
        .await
        .expect("the holder process acquires");
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "HELD {}", handle.fencing_token()).expect("report the lock");
        out.flush().expect("flush");
    }
    tokio::time::sleep(Duration::from_secs(600)).await;
    drop(handle);
}
