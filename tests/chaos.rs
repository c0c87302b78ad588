//! The chaos suite: faults injected into real PostgreSQL and Azurite servers (and into the
//! in-memory provider, where a fault has a meaning there).
//!
//! Every case runs against a server of its own, started by the fixtures, and every "process" (a
//! `DistributedLock` with its own pool or HTTP client) reaches that server through a
//! [`FaultProxy`] of its own, so a network fault hits exactly one process. Each case checks that
//! loss is declared on time — before the backend could hand the lock to anyone else — that the
//! lost token fires and `run` drops its work, that no two holds overlap and fencing tokens grow
//! (the interval checker), and that the lock works again once the fault is gone.
//!
//! # Timing
//! Leases and intervals are short so the suite stays fast: Azure's shortest lease (15 s, so
//! renewals every 5 s and a loss deadline 13.5 s after the last successful renewal was sent),
//! and a PostgreSQL check every second with a one-second statement timeout.
//!
//! The engine's loss deadline runs from the instant it *sent* its last successful renewal or
//! check. The test cannot see that instant, but each process's proxy sees when the request
//! arrived and whether it was answered, which bounds it from outside: the engine sent no later
//! than the proxy read ([`FaultProxy::last_answered_request`]), and no earlier than
//! [`SEND_SKEW`] before.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use azure_storage_blob::models::BlobClientBreakLeaseOptions;
use lockingkit::backend::{BackendErrorKind, LockBackend};
use lockingkit::keys::AzureLockKeys;
use lockingkit::providers::azure::AzureBlobLease;
use lockingkit::testing::{quick_polling, unique_prefix, IntervalChecker};
use lockingkit::{
    AzureBlobBackend, AzureBlobOptions, DistributedLock, ErrorKind, LockError, LockMode,
    LossReason, PostgresBackend, PostgresOptions,
};
use lockingkit_tests::azurite::{Azurite, Persistence, DEV_ACCOUNT, DEV_KEY};
use lockingkit_tests::chaos::{
    acquire_through_outages, assert_lost, assert_near, contender_lock, record, Loss, Process,
    Watched, PATIENCE,
};
use lockingkit_tests::checks::assert_semaphore_full;
use lockingkit_tests::os::this_test_again;
use lockingkit_tests::postgres::PostgresServer;
use lockingkit_tests::proxy::{Fault, FaultProxy};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The PostgreSQL check interval.
const CHECK: Duration = Duration::from_secs(1);
/// The PostgreSQL statement timeout (a hung check fails after this or the interval, whichever
/// is shorter).
const QUERY_TIMEOUT: Duration = Duration::from_secs(1);
/// The Azure lease: the shortest Azure grants.
const LEASE: Duration = Duration::from_secs(15);
/// Azure renews every third of the lease.
const RENEW_EVERY: Duration = Duration::from_secs(5);
/// Each Azure call, retries included, gives up after this (at most a third of the lease).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// How much earlier than the proxy read it the engine may have sent a request. The client's own
/// pipeline runs in between — a pool checkout and a hop to the connection task for PostgreSQL,
/// Shared Key signing and the HTTP pool for Azure — which takes microseconds on an idle machine
/// and can take a few hundred milliseconds on this 2-core machine while other test processes and
/// builds compete for it.
const SEND_SKEW: Duration = Duration::from_millis(300);

/// How late after its deadline an Azure loss may be observed: the engine's keeper and the test's
/// watching task are tokio tasks on a loaded 2-core machine. One second keeps the loss inside
/// the 1.5 s safety margin between the 13.5 s deadline and the 15 s lease, which is the bound
/// that matters (asserted separately).
const AZURE_LATE: Duration = Duration::from_secs(1);

/// How late after its deadline a PostgreSQL loss may be observed: as [`AZURE_LATE`], scaled to
/// a one-second interval. While a server is paused or a line blackholed nobody else can take the
/// lock, so this bounds the engine's promptness, not safety.
const POSTGRES_LATE: Duration = Duration::from_millis(500);

// ----------------------------------------------------------------------------------------------
// Servers and processes
// ----------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Postgres,
    Azure,
}

/// A real server with process control.
enum Server {
    Postgres(PostgresServer),
    Azure(Azurite),
}

impl Server {
    async fn postgres() -> Server {
        Server::Postgres(PostgresServer::start_local().await)
    }

    /// A local Azurite; `None` (the case is skipped) when the environment names an external
    /// service, which cannot be killed or paused from here.
    /// A local Azurite, even when the environment names an external one: faults need a
    /// process to kill, pause and restart, so the chaos suite never skips a case.
    async fn azure(persistence: Persistence) -> Server {
        Server::Azure(Azurite::start_local(persistence).await)
    }

    fn kind(&self) -> Kind {
        match self {
            Server::Postgres(_) => Kind::Postgres,
            Server::Azure(_) => Kind::Azure,
        }
    }

    fn port(&self) -> u16 {
        match self {
            Server::Postgres(server) => server.port(),
            Server::Azure(azurite) => azurite.port(),
        }
    }

    /// SIGKILL, as a crash.
    fn kill(&mut self) {
        match self {
            Server::Postgres(server) => server.kill(),
            Server::Azure(azurite) => azurite.kill(),
        }
    }

    /// SIGSTOP: connections stay open and nothing answers.
    fn pause(&mut self) {
        match self {
            Server::Postgres(server) => server.pause(),
            Server::Azure(azurite) => azurite.pause(),
        }
    }

    fn resume(&mut self) {
        match self {
            Server::Postgres(server) => server.resume(),
            Server::Azure(azurite) => azurite.resume(),
        }
    }

    /// Starts a killed server again on the same port.
    async fn start_again(&mut self) {
        match self {
            Server::Postgres(server) => server.start_again().await,
            Server::Azure(azurite) => azurite.restart().await,
        }
    }

    /// Stops a running server (PostgreSQL: immediate mode, every session ends; Azurite:
    /// gracefully, saving its store) and starts it again on the same port.
    async fn restart(&mut self) {
        match self {
            Server::Postgres(server) => server.restart().await,
            Server::Azure(azurite) => azurite.restart().await,
        }
    }

    /// A new "process" that reaches this server through a proxy of its own.
    async fn process(&self, id: usize) -> Process {
        let proxy = FaultProxy::to_port(self.port()).await;
        let locks = lock_through(self.kind(), proxy.port());
        Process { id, proxy, locks }
    }

    /// How long after the last answered renewal or check a hang is declared loss: Azure at 90%
    /// of the lease; PostgreSQL when the next check (one interval later) times out.
    fn hang_loss_after(&self) -> Duration {
        match self {
            Server::Postgres(_) => CHECK + CHECK.min(QUERY_TIMEOUT),
            Server::Azure(_) => LEASE * 9 / 10,
        }
    }

    fn late(&self) -> Duration {
        match self {
            Server::Postgres(_) => POSTGRES_LATE,
            Server::Azure(_) => AZURE_LATE,
        }
    }
}

fn connection_string(kind: Kind, port: u16) -> String {
    match kind {
        Kind::Postgres => {
            format!("host=127.0.0.1 port={port} user=postgres dbname=postgres sslmode=disable")
        }
        Kind::Azure => format!(
            "DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};\
             BlobEndpoint=http://127.0.0.1:{port}/{DEV_ACCOUNT}"
        ),
    }
}

/// A `DistributedLock` of `kind` whose backend lives behind `port`, polling quickly.
fn lock_through(kind: Kind, port: u16) -> DistributedLock {
    let connection_string = connection_string(kind, port);
    match kind {
        Kind::Postgres => {
            let backend = PostgresBackend::new(
                PostgresOptions::new(connection_string)
                    .with_check_interval(CHECK)
                    .with_query_timeout(QUERY_TIMEOUT),
            )
            .expect("valid PostgreSQL options");
            DistributedLock::builder(backend)
                .options(quick_polling())
                .build()
                .expect("valid lock options")
        }
        Kind::Azure => {
            let backend = AzureBlobBackend::new(
                AzureBlobOptions::from_connection_string(connection_string)
                    .with_lease_duration(LEASE)
                    .with_request_timeout(REQUEST_TIMEOUT),
            )
            .expect("valid Azure options");
            DistributedLock::builder(backend)
                .options(quick_polling())
                .build()
                .expect("valid lock options")
        }
    }
}

// ----------------------------------------------------------------------------------------------
// After a fault (watching a hold for loss: `lockingkit_tests::chaos`)
// ----------------------------------------------------------------------------------------------

/// Checks the hand-over after a PostgreSQL session ended under its holder (terminated, or its
/// connection reset). The server frees the lock the instant the session ends, and the holder
/// can only learn of it by asking: the engine's next check, at most one interval later
/// (`check_interval`, docs/postgres.md). So a contender may take the lock before the holder declares loss — no client
/// design can close that window, only shorten it — and the fencing token is what protects the
/// resource inside it. What must hold: the contender got the lock only after the session
/// ended, and the window stays within one check interval (plus scheduling slack).
#[track_caller]
fn assert_session_handover(ended: Instant, lost_at: Instant, contender_start: Instant) {
    assert!(
        contender_start >= ended,
        "the contender got the lock before the holder's session ended"
    );
    let window = lost_at.saturating_duration_since(contender_start);
    assert!(
        window <= CHECK + POSTGRES_LATE,
        "the holder still believed it held the lock {window:?} after the contender took it"
    );
}

/// Lets the hold reach a steady state, so the loss the case provokes is measured from a
/// renewal or check, not from the acquire: one Azure renewal (a single request), or two
/// PostgreSQL checks (the first also prepares its statement, a round trip of its own, so only
/// from the second on is one answered request one successful check).
async fn settle(kind: Kind, process: &Process, watched: &Watched) {
    let after = match kind {
        Kind::Postgres => watched.acquired + CHECK * 3 / 2,
        Kind::Azure => watched.acquired,
    };
    process.answered_after(after).await;
}

// ----------------------------------------------------------------------------------------------
// 1. Backend killed while a lock is held
// ----------------------------------------------------------------------------------------------

async fn killed_backend(mut server: Server) {
    let key = unique_prefix("chaos/killed");
    let checker = IntervalChecker::new();
    let (holder, other) = (server.process(0).await, server.process(1).await);
    let watched = holder.hold_watched(&key).await;
    settle(server.kind(), &holder, &watched).await;
    if server.kind() == Kind::Azure {
        // Azurite's on-disk store is saved every 5 s (LokiJS autosave), so a crash loses the
        // last few seconds of writes; real Azure never loses an acknowledged write. Wait until
        // the fencing token written at acquire is on disk, or the restarted server would hand
        // it out again.
        tokio::time::sleep_until(watched.acquired + Duration::from_secs(6)).await;
    }
    let holder_token = watched.token;
    let killed = Instant::now();
    server.kill();

    // While the server is down, a waiter is told it is unavailable, not that it timed out.
    // (The one-shot attempt comes first: an attempt that a timed-out `acquire` left in flight
    // finishes in the background and keeps the key's turn until then, so a `try_acquire`
    // straight after would be told `Busy` by the engine without asking the server.)
    let error = other
        .locks
        .try_acquire(&key)
        .await
        .expect_err("dead server");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let error = other
        .locks
        .acquire(&key, Duration::from_secs(2))
        .await
        .expect_err("nothing can be acquired from a dead server");
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");

    let (loss, hold) = watched.lost_within(PATIENCE).await;
    checker.record(hold);
    match server.kind() {
        Kind::Postgres => {
            // The session died with the server; the next check (at most one interval later)
            // finds the connection closed.
            assert_lost(&loss, LossReason::ConnectionLost);
            assert_near(
                "loss",
                loss.at,
                killed,
                Duration::ZERO,
                CHECK + POSTGRES_LATE,
            );
        }
        Kind::Azure => {
            // Renewals fail from the kill on; they are retried until the deadline.
            assert_lost(&loss, LossReason::Deadline);
            let last = holder.proxy.last_answered_request().expect("a renewal");
            assert!(last < killed);
            assert_near(
                "loss",
                loss.at,
                last + server.hang_loss_after(),
                SEND_SKEW,
                AZURE_LATE,
            );
        }
    }

    server.start_again().await;
    // A server back sooner than the engine's reconnect pacing (`OUTAGE_MOST` in
    // lockingkit/src/health.rs: up to 900 ms between connects after a failure) is not asked
    // until the next connect is due; until then an acquire is told `Unavailable` at once.
    let (handle, _) = acquire_through_outages(&other.locks, &key, PATIENCE)
        .await
        .unwrap_or_else(|e| panic!("process {} could not acquire: {e}", other.id));
    let start = Instant::now();
    assert!(
        handle.fencing_token() > holder_token,
        "tokens survive a crash"
    );
    let token = handle.fencing_token();
    record(&checker, &key, other.id, token, start);
    handle.release().await.expect("release after the restart");
    holder.usable_again(&key, &checker, token).await;
    checker.assert_consistent();
}

// ----------------------------------------------------------------------------------------------
// 2. Backend paused so renewals and checks hang
// ----------------------------------------------------------------------------------------------

async fn paused_backend(mut server: Server) {
    let key = unique_prefix("chaos/paused");
    let checker = IntervalChecker::new();
    let (holder, other) = (server.process(0).await, server.process(1).await);
    let watched = holder.hold_watched(&key).await;
    settle(server.kind(), &holder, &watched).await;
    let contender = other.wait_through_outages_for(&key);
    let holder_token = watched.token;
    let paused = Instant::now();
    server.pause();

    let (loss, hold) = watched.lost_within(PATIENCE).await;
    // Only the deadline timer can end a hold whose renewals never answer.
    let last = holder.proxy.last_answered_request().expect("a renewal");
    assert!(last < paused);
    let expected = last + server.hang_loss_after();
    assert_near("loss", loss.at, expected, SEND_SKEW, server.late());
    if server.kind() == Kind::Azure {
        // The server cannot expire the lease before 15 s after it received the renewal.
        assert!(
            loss.at < last + LEASE,
            "loss declared after the lease ran out"
        );
    }
    assert_lost(
        &loss,
        match server.kind() {
            Kind::Postgres => LossReason::ConnectionLost,
            Kind::Azure => LossReason::Deadline,
        },
    );
    assert!(
        !contender.is_finished(),
        "nobody else may hold the lock before the first declared loss"
    );
    checker.record(hold);

    server.resume();
    let (handle, start) = contender_lock(contender).await;
    assert!(start > loss.at);
    assert!(handle.fencing_token() > holder_token);
    let token = handle.fencing_token();
    record(&checker, &key, other.id, token, start);
    handle.release().await.expect("release after the resume");
    holder.usable_again(&key, &checker, token).await;
    checker.assert_consistent();
}

// ----------------------------------------------------------------------------------------------
// 3. Backend restarted under 20 waiters from 4 processes
// ----------------------------------------------------------------------------------------------

async fn restarted_under_waiters(mut server: Server) {
    const PROCESSES: usize = 4;
    const WAITERS_EACH: usize = 5;
    const TOTAL: usize = PROCESSES * WAITERS_EACH;
    // Long enough that the restart lands inside a hold, not only between holds.
    const HOLD: Duration = Duration::from_millis(400);
    let key = unique_prefix("chaos/restart");
    let checker = Arc::new(IntervalChecker::new());
    let done = Arc::new(AtomicUsize::new(0));
    let holding = Arc::new(AtomicUsize::new(0));
    let progress = Arc::new(tokio::sync::Notify::new());
    let mut processes = Vec::new();
    for id in 0..PROCESSES {
        processes.push(server.process(id).await);
    }
    let mut waiters = Vec::new();
    for process in &processes {
        for _ in 0..WAITERS_EACH {
            let (locks, id, key) = (process.locks.clone(), process.id, key.clone());
            let (checker, done, progress) = (checker.clone(), done.clone(), progress.clone());
            let holding = holding.clone();
            waiters.push(tokio::spawn(async move {
                // Long enough to ride out the restart and a lease left behind by it; the
                // outage itself ends the waits it meets, which are tried again.
                let (handle, outages) =
                    acquire_through_outages(&locks, &key, Duration::from_secs(120)).await?;
                let start = Instant::now();
                holding.fetch_add(1, Ordering::SeqCst);
                progress.notify_waiters();
                // The hold ends when the work ends or the lock is lost, whichever comes first.
                let worked = handle.run(tokio::time::sleep(HOLD)).await;
                record(&checker, &key, id, handle.fencing_token(), start);
                holding.fetch_sub(1, Ordering::SeqCst);
                let released = handle.release().await;
                let outcome = match worked {
                    Ok(()) => {
                        // The work finished first. A release cut off by the restart is not
                        // confirmed; the backend frees the lock anyway.
                        if let Err(error) = &released {
                            assert_ne!(
                                error.kind(),
                                ErrorKind::Lost,
                                "lost after the work: {error}"
                            );
                        }
                        HoldEnd::Finished
                    }
                    Err(error) => {
                        assert_eq!(error.kind(), ErrorKind::Lost, "{error}");
                        assert_eq!(released.expect_err("a lost lock").kind(), ErrorKind::Lost);
                        HoldEnd::Lost
                    }
                };
                done.fetch_add(1, Ordering::SeqCst);
                progress.notify_waiters();
                Ok::<_, LockError>((outcome, outages))
            }));
        }
    }
    // Restart while a hold is in progress, once a few holds are done and most waiters wait.
    loop {
        let notified = progress.notified();
        if done.load(Ordering::SeqCst) >= 3 && holding.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::timeout(PATIENCE, notified)
            .await
            .expect("the first holds finish");
    }
    let before = done.load(Ordering::SeqCst);
    server.restart().await;
    let restarted = Instant::now();
    let (mut lost, mut outages) = (0, 0);
    for waiter in waiters {
        let (end, met) = tokio::time::timeout(Duration::from_secs(150), waiter)
            .await
            .expect("every waiter finishes")
            .expect("the waiter task")
            .expect("every waiter acquires eventually");
        lost += usize::from(end == HoldEnd::Lost);
        outages += met;
    }
    // The waiters were told of the outage rather than left to wait through it unaware.
    assert!(outages > 0, "no wait was told of the restart");
    let holds = checker.holds();
    assert_eq!(holds.len(), TOTAL);
    assert!(
        before < TOTAL / 2,
        "the restart came while most still waited"
    );
    assert!(
        holds.iter().any(|h| h.start > restarted),
        "waiters acquired after the restart"
    );
    if server.kind() == Kind::Postgres {
        // Every session ends with the server, and the hold in progress with it.
        assert!(lost >= 1, "the hold that spanned the restart was lost");
    }
    checker.assert_consistent();
}

/// How a hold of the restart case ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HoldEnd {
    Finished,
    Lost,
}

// ----------------------------------------------------------------------------------------------
// 6. Proxy faults mid-hold
// ----------------------------------------------------------------------------------------------

async fn proxy_fault(server: Server, fault: Fault) {
    let key = unique_prefix("chaos/proxy");
    let checker = IntervalChecker::new();
    let (holder, other) = (server.process(0).await, server.process(1).await);
    let watched = holder.hold_watched(&key).await;
    settle(server.kind(), &holder, &watched).await;
    let contender = other.wait_through_outages_for(&key);
    let holder_token = watched.token;
    let connections_before = holder.proxy.connections_accepted();
    let faulted = Instant::now();
    holder.proxy.set_fault(fault);

    let (loss, hold) = watched.lost_within(PATIENCE).await;
    let last = holder.proxy.last_answered_request().expect("a renewal");
    let mut session_ended = false;
    match (server.kind(), fault) {
        (Kind::Postgres, Fault::Reset) => {
            // A reset connection is closed at once; the next check finds it so.
            assert_lost(&loss, LossReason::ConnectionLost);
            assert_near(
                "loss",
                loss.at,
                faulted,
                Duration::ZERO,
                CHECK + POSTGRES_LATE,
            );
            session_ended = true;
        }
        (Kind::Postgres, _) => {
            assert_lost(&loss, LossReason::ConnectionLost);
            assert_near(
                "loss",
                loss.at,
                last + server.hang_loss_after(),
                SEND_SKEW,
                POSTGRES_LATE,
            );
            // The session lives on behind the partition, so the lock stays taken.
            assert!(!contender.is_finished());
        }
        (Kind::Azure, _) => {
            assert_lost(&loss, LossReason::Deadline);
            assert_near(
                "loss",
                loss.at,
                last + server.hang_loss_after(),
                SEND_SKEW,
                AZURE_LATE,
            );
            assert!(
                loss.at < last + LEASE,
                "loss declared after the lease ran out"
            );
        }
    }
    holder.proxy.set_fault(Fault::Pass);
    let (handle, start) = contender_lock(contender).await;
    if session_ended {
        assert_session_handover(faulted, loss.at, start);
    } else {
        checker.record(hold);
    }
    assert!(handle.fencing_token() > holder_token);
    let token = handle.fencing_token();
    record(&checker, &key, other.id, token, start);
    handle.release().await.expect("release");
    holder.usable_again(&key, &checker, token).await;
    if fault == Fault::Reset {
        // Reset connections are gone for good: the holder's process came back on new ones.
        assert!(holder.proxy.connections_accepted() > connections_before);
    }
    checker.assert_consistent();
}

// ----------------------------------------------------------------------------------------------
// 7. A holder that vanishes without releasing
// ----------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Vanish {
    /// The holder's OS process is killed (SIGKILL).
    ProcessKilled,
    /// The holder's tokio runtime is dropped with the handle's task: nothing runs any more.
    RuntimeDropped,
}

const CHILD_KIND: &str = "LOCKINGKIT_CHAOS_CHILD_KIND";
const CHILD_PORT: &str = "LOCKINGKIT_CHAOS_CHILD_PORT";
const CHILD_KEY: &str = "LOCKINGKIT_CHAOS_CHILD_KEY";

/// Kills the child process when dropped, so a failing case leaves nothing behind.
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Takes the lock in a separate OS process (this test binary, running
/// [`vanishing_holder_process`]) and returns it with the fencing token it reported.
async fn holder_process(kind: Kind, port: u16, key: &str) -> (ChildGuard, u64) {
    let mut child = this_test_again(module_path!(), "vanishing_holder_process")
        .env(
            CHILD_KIND,
            match kind {
                Kind::Postgres => "postgres",
                Kind::Azure => "azure",
            },
        )
        .env(CHILD_PORT, port.to_string())
        .env(CHILD_KEY, key)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the holder process");
    let stdout = child.stdout.take().expect("piped stdout");
    let guard = ChildGuard(child);
    let token = tokio::time::timeout(
        PATIENCE,
        tokio::task::spawn_blocking(move || {
            let lines = BufReader::new(stdout).lines();
            for line in lines.map_while(Result::ok) {
                if let Some(token) = line.strip_prefix("HELD ") {
                    return token.trim().parse::<u64>().ok();
                }
            }
            None
        }),
    )
    .await
    .expect("the holder process reports its lock")
    .expect("the reading task")
    .expect("the holder process took the lock");
    (guard, token)
}

/// Takes the lock on a runtime of its own in a thread; dropping the runtime is the vanishing.
/// Returns the token and a sender that drops the runtime when signalled, and a receiver that
/// says it is gone.
fn holder_runtime(
    kind: Kind,
    port: u16,
    key: &str,
) -> (
    u64,
    std::sync::mpsc::Sender<()>,
    std::sync::mpsc::Receiver<()>,
) {
    let (token_tx, token_rx) = std::sync::mpsc::channel();
    let (vanish_tx, vanish_rx) = std::sync::mpsc::channel::<()>();
    let (gone_tx, gone_rx) = std::sync::mpsc::channel();
    let key = key.to_owned();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let handle = runtime.block_on(async {
            lock_through(kind, port)
                .acquire(&key, PATIENCE)
                .await
                .expect("the vanishing holder acquires")
        });
        let _ = token_tx.send(handle.fencing_token());
        // The handle lives in a task, as in a service; the task dies with the runtime, and the
        // release its drop would start has no runtime left to run on.
        runtime.spawn(async move {
            let _handle = handle;
            std::future::pending::<()>().await
        });
        let _ = vanish_rx.recv();
        drop(runtime);
        let _ = gone_tx.send(());
    });
    let token = token_rx
        .recv_timeout(PATIENCE)
        .expect("the vanishing holder took the lock");
    (token, vanish_tx, gone_rx)
}

async fn vanished_holder(server: Server, how: Vanish) {
    let key = unique_prefix("chaos/vanish");
    let checker = IntervalChecker::new();
    let line = FaultProxy::to_port(server.port()).await;
    let other = server.process(1).await;
    let holder_token;
    let vanished;
    match how {
        Vanish::ProcessKilled => {
            let (mut child, token) = holder_process(server.kind(), line.port(), &key).await;
            holder_token = token;
            if server.kind() == Kind::Postgres {
                // Killed while its checks run, not before the first.
                tokio::time::timeout(PATIENCE, line.exchange_after(Instant::now()))
                    .await
                    .expect("a check");
            }
            child.0.kill().expect("SIGKILL the holder");
            child.0.wait().expect("reap the holder");
            vanished = Instant::now();
        }
        Vanish::RuntimeDropped => {
            let (token, vanish, gone) = holder_runtime(server.kind(), line.port(), &key);
            holder_token = token;
            vanish.send(()).expect("the holder thread");
            tokio::task::spawn_blocking(move || gone.recv_timeout(PATIENCE))
                .await
                .expect("the waiting task")
                .expect("the runtime was dropped");
            vanished = Instant::now();
        }
    }
    let holder_last = line
        .exchanges()
        .last()
        .copied()
        .expect("the holder's requests");
    let (handle, start) = other.acquire(&key).await;
    match server.kind() {
        Kind::Postgres => {
            // The kernel closes a dead process's sockets, and a dropped runtime drops its
            // connections; PostgreSQL ends the session on the close and frees the lock. The
            // contender polls at most 100 ms apart; the rest is slack for a loaded machine.
            assert!(
                start - vanished < Duration::from_secs(1),
                "the lock was freed {:?} after the holder vanished",
                start - vanished
            );
        }
        Kind::Azure => {
            // Nobody renews or releases: Azure frees the lock when the lease runs out, 15 s
            // after the service received the last renewal (or the acquire), which it did
            // between the proxy reading it and answering it. 100 ms covers Azurite's
            // millisecond timestamps; the upper side allows for the contender's polling
            // (100 ms), its own request (two or three round trips) and a loaded machine.
            let freed_after = holder_last.sent + LEASE;
            assert_near(
                "the next acquire",
                start,
                freed_after,
                Duration::from_millis(100),
                Duration::from_millis(1500) + (holder_last.answered - holder_last.sent),
            );
        }
    }
    assert!(handle.fencing_token() > holder_token);
    record(&checker, &key, other.id, handle.fencing_token(), start);
    handle.release().await.expect("release");
    checker.assert_consistent();
}

/// Not a case of its own: the holder process that the `vanishing_holder` cases start and kill.
/// It does nothing unless started by them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a separate process by the vanishing-holder cases"]
async fn vanishing_holder_process() {
    let (Ok(kind), Ok(port), Ok(key)) = (
        std::env::var(CHILD_KIND),
        std::env::var(CHILD_PORT),
        std::env::var(CHILD_KEY),
    ) else {
        return;
    };
    let kind = if kind == "azure" {
        Kind::Azure
    } else {
        Kind::Postgres
    };
    let port = port.parse().expect("a port");
    let handle = lock_through(kind, port)
        .acquire(&key, PATIENCE)
        .await
        .expect("the holder process acquires");
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "HELD {}", handle.fencing_token()).expect("report the lock");
        out.flush().expect("flush");
    }
    // HeldInterval (and renew) until killed.
    tokio::time::sleep(Duration::from_secs(600)).await;
    drop(handle);
}

// ----------------------------------------------------------------------------------------------
// 8. Latency on every request
// ----------------------------------------------------------------------------------------------

async fn slow_network(server: Server) {
    const LATENCY: Duration = Duration::from_millis(200);
    let key = unique_prefix("chaos/latency");
    let checker = IntervalChecker::new();
    let (holder, other) = (server.process(0).await, server.process(1).await);
    holder.proxy.set_latency(LATENCY);
    other.proxy.set_latency(LATENCY);
    // Through at least two renewals (Azure) or three checks (PostgreSQL).
    let hold_for = match server.kind() {
        Kind::Postgres => CHECK * 3 + CHECK / 2,
        Kind::Azure => RENEW_EVERY * 2 + RENEW_EVERY / 2,
    };
    let (handle, start) = holder.acquire(&key).await;
    let contender = other.wait_through_outages_for(&key);
    handle
        .run(tokio::time::sleep(hold_for))
        .await
        .expect("no false loss under latency");
    assert!(handle.is_held());
    assert!(!handle.lost_token().is_cancelled());
    let token = handle.fencing_token();
    record(&checker, &key, holder.id, token, start);
    handle.release().await.expect("release under latency");

    let renewals = holder
        .proxy
        .exchanges()
        .into_iter()
        .filter(|e| e.sent > start)
        .count();
    assert!(
        renewals >= 2,
        "{renewals} renewals or checks during the hold"
    );
    assert!(
        holder
            .proxy
            .exchanges()
            .iter()
            .all(|e| e.answered - e.sent >= LATENCY),
        "every request was delayed"
    );

    let (handle, start) = contender_lock(contender).await;
    assert!(handle.fencing_token() > token);
    handle
        .run(tokio::time::sleep(Duration::from_millis(100)))
        .await
        .expect("held");
    record(&checker, &key, other.id, handle.fencing_token(), start);
    handle.release().await.expect("release");
    checker.assert_consistent();
}

// ----------------------------------------------------------------------------------------------
// 9. Azure semaphore slots: a fault on one slot is that holder's alone
// ----------------------------------------------------------------------------------------------

/// A semaphore of three holders.
const THREE_SLOTS: LockMode = LockMode::Semaphore { max_count: 3 };

const CHILD_SLOT_PORT: &str = "LOCKINGKIT_CHAOS_CHILD_SLOT_PORT";
const CHILD_SLOT_KEY: &str = "LOCKINGKIT_CHAOS_CHILD_SLOT_KEY";

/// An Azure backend behind `port`, with the chaos suite's lease and request timeout, driven
/// directly (renewals included) as the engine would drive it.
fn slot_backend(port: u16) -> AzureBlobBackend {
    AzureBlobBackend::new(
        AzureBlobOptions::from_connection_string(connection_string(Kind::Azure, port))
            .with_lease_duration(LEASE)
            .with_request_timeout(REQUEST_TIMEOUT),
    )
    .expect("valid Azure options")
}

/// One attempt at a free slot of `key`.
async fn try_slot(backend: &AzureBlobBackend, key: &str) -> Option<AzureBlobLease> {
    backend
        .try_acquire(key, THREE_SLOTS)
        .await
        .unwrap_or_else(|e| panic!("a semaphore attempt failed: {e}"))
        .map(|acquired| acquired.lease)
}

fn slot_of(lease: &AzureBlobLease) -> u32 {
    lease.semaphore_slot().expect("a slot lease")
}

/// Renews `lease` every [`RENEW_EVERY`] until the task is aborted, panicking on a failure: a
/// holder the case expects to keep its slot throughout.
fn keep_renewing(backend: AzureBlobBackend, lease: AzureBlobLease) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(RENEW_EVERY).await;
            backend
                .renew(&lease)
                .await
                .unwrap_or_else(|e| panic!("slot {} lost its lease: {e}", slot_of(&lease)));
        }
    })
}

/// A write to the slot's blob fenced by the lease: `Ok` only while the lease is this holder's.
async fn fenced_write(lease: &AzureBlobLease) -> Result<(), u16> {
    lease
        .blob_client()
        .upload(
            azure_core::http::RequestContent::from(b"written under a slot".to_vec()),
            Some(lease.upload_options()),
        )
        .await
        .map(drop)
        .map_err(|e| e.http_status().map(u16::from).unwrap_or(0))
}

/// Polls for a slot every 100 ms; returns it with the instant it was granted.
async fn poll_for_slot(backend: &AzureBlobBackend, key: &str) -> (AzureBlobLease, Instant) {
    tokio::time::timeout(PATIENCE, async {
        loop {
            if let Some(lease) = try_slot(backend, key).await {
                return (lease, Instant::now());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("a slot within the patience")
}

/// Three holders in three processes; one slot's lease is broken by a plain SDK client. Only
/// that holder loses (its next renewal is told the lease is gone, its fenced writes are
/// refused); the others renew and write on, and the freed slot goes to the next acquirer with
/// a higher token of that slot.
async fn broken_slot_lease(azurite: &Azurite) {
    let key = unique_prefix("chaos/slot-broken");
    let backends: Vec<_> = (0..4).map(|_| slot_backend(azurite.port())).collect();
    let mut held = Vec::new();
    for backend in &backends[..3] {
        held.push(try_slot(backend, &key).await.expect("a free slot"));
    }
    let victim = held[1].clone();
    azurite
        .plain_container_client("locks")
        .blob_client(&AzureLockKeys::semaphore_slot_blob_name(
            &key,
            slot_of(&victim),
        ))
        .break_lease(Some(BlobClientBreakLeaseOptions {
            break_period: Some(0),
            ..Default::default()
        }))
        .await
        .expect("a plain SDK client breaks the slot's lease");

    let error = backends[1].renew(&victim).await.unwrap_err();
    assert_eq!(error.kind(), BackendErrorKind::LeaseGone, "{error}");
    assert_eq!(fenced_write(&victim).await, Err(412));
    for (backend, lease) in [(&backends[0], &held[0]), (&backends[2], &held[2])] {
        backend
            .renew(lease)
            .await
            .expect("the other holders keep their slots");
        fenced_write(lease)
            .await
            .expect("a fenced write on a kept slot");
    }

    let next = try_slot(&backends[3], &key)
        .await
        .expect("the broken slot is free");
    assert_eq!(slot_of(&next), slot_of(&victim));
    assert!(next.fencing_token() > victim.fencing_token());
    // Three holders again: the victim cannot slip back in, and nobody lost a second slot.
    assert!(try_slot(&backends[1], &key).await.is_none());
    for (backend, lease) in [
        (&backends[0], &held[0]),
        (&backends[2], &held[2]),
        (&backends[3], &next),
    ] {
        backend.renew(lease).await.expect("still held");
        fenced_write(lease)
            .await
            .expect("still fenced by its own lease");
    }
    for (backend, lease) in [
        (&backends[0], &held[0]),
        (&backends[2], &held[2]),
        (&backends[3], &next),
    ] {
        backend.release(lease).await.expect("release");
    }
}

/// As [`broken_slot_lease`], through `DistributedLock::semaphore` in three processes: the
/// victim's engine declares `LeaseGone` at its next renewal and `run` drops its work, while the
/// other two handles stay held through that renewal and the next.
async fn broken_slot_lease_through_the_engine(server: Server) {
    let Server::Azure(azurite) = &server else {
        unreachable!("an Azure case")
    };
    let key = unique_prefix("chaos/slot-broken-engine");
    let mut processes = Vec::new();
    for id in 0..4 {
        processes.push(server.process(id).await);
    }
    let mut watched = Vec::new();
    let mut leases = Vec::new();
    for process in &processes[..3] {
        let handle = process
            .locks
            .semaphore(&key, 3)
            .expect("a semaphore of three")
            .acquire(PATIENCE)
            .await
            .expect("a slot");
        leases.push(handle.azure_blob_lease().expect("an Azure lease"));
        watched.push(Watched::new(process.id, handle, Instant::now()));
    }
    let victim = watched.remove(1);
    let victim_lease = leases.remove(1);
    let renewal = tokio::time::timeout(
        RENEW_EVERY * 2,
        processes[1].proxy.exchange_after(victim.acquired),
    )
    .await
    .expect("a renewal of the victim's slot");
    azurite
        .plain_container_client("locks")
        .blob_client(&AzureLockKeys::semaphore_slot_blob_name(
            &key,
            slot_of(&victim_lease),
        ))
        .break_lease(Some(BlobClientBreakLeaseOptions {
            break_period: Some(0),
            ..Default::default()
        }))
        .await
        .expect("a plain SDK client breaks the slot's lease");

    let (loss, _) = victim.lost_within(PATIENCE).await;
    assert_lost(&loss, LossReason::LeaseGone);
    assert_near(
        "loss",
        loss.at,
        renewal.sent + RENEW_EVERY,
        SEND_SKEW,
        AZURE_LATE,
    );
    // The others renew through the loss and one more period without losing anything.
    let after = loss.at + RENEW_EVERY;
    for process in [&processes[0], &processes[2]] {
        tokio::time::timeout(PATIENCE, process.proxy.exchange_after(after))
            .await
            .expect("a renewal after the victim's loss");
    }
    for kept in &watched {
        assert!(
            !kept.loss.is_finished(),
            "process {} lost its slot",
            kept.process
        );
    }
    let next = processes[3]
        .locks
        .semaphore(&key, 3)
        .expect("a semaphore of three")
        .try_acquire()
        .await
        .expect("the broken slot is free");
    let next_lease = next.azure_blob_lease().expect("an Azure lease");
    assert_eq!(slot_of(&next_lease), slot_of(&victim_lease));
    assert!(next.fencing_token() > victim_lease.fencing_token());
    assert_semaphore_full(&processes[1].locks, &key, 3).await;
    next.release().await.expect("release");
    for kept in watched {
        kept.loss.abort();
    }
}

/// How a semaphore slot holder vanishes.
#[derive(Clone, Copy, Debug)]
enum SlotVanish {
    /// The holder stops renewing and never releases: its lease is left to expire.
    LeaseLeft,
    /// The holder's OS process is killed while it renews.
    ProcessKilled,
}

/// Two holders keep their slots; the third vanishes. A contender polling all along gets the
/// vanished holder's slot when its lease runs out — 15 s after the service last took the
/// acquire or a renewal — and not before; the others never lose theirs.
async fn vanished_slot_holder(azurite: &Azurite, how: SlotVanish) {
    let key = unique_prefix("chaos/slot-vanish");
    let line = FaultProxy::to_port(azurite.port()).await;
    let keepers: Vec<_> = (0..2).map(|_| slot_backend(azurite.port())).collect();
    let mut renewing = Vec::new();
    let mut kept = Vec::new();
    for backend in &keepers {
        let lease = try_slot(backend, &key).await.expect("a free slot");
        kept.push(lease.clone());
        renewing.push(keep_renewing(backend.clone(), lease));
    }
    let (vanished_slot, vanished_token, _child) = match how {
        SlotVanish::LeaseLeft => {
            let lease = try_slot(&slot_backend(line.port()), &key)
                .await
                .expect("the third slot");
            (slot_of(&lease), lease.fencing_token(), None)
        }
        SlotVanish::ProcessKilled => {
            let (mut child, slot, token) = slot_holder_process(line.port(), &key).await;
            // Killed after a renewal, so the lease runs out from the renewal, not the acquire.
            let acquired = Instant::now();
            tokio::time::timeout(PATIENCE, line.exchange_after(acquired + RENEW_EVERY / 2))
                .await
                .expect("a renewal by the holder process");
            child.0.kill().expect("SIGKILL the holder");
            child.0.wait().expect("reap the holder");
            (slot, token, Some(child))
        }
    };
    // The service starts the lease when it takes the request, between the proxy reading it and
    // reading the answer; the last one is the acquire's metadata write or the last renewal,
    // both under the lease, so the lease runs out no later than LEASE after it was answered and
    // no earlier than LEASE after the lease request was read.
    let exchanges = line.exchanges();
    let last = *exchanges.last().expect("the holder's requests");
    let lease_taken = match how {
        // The attempt's lease request is the first exchange that got the slot: with two other
        // slots taken it is preceded by up to two busy probes, so bound it by the first request.
        SlotVanish::LeaseLeft => exchanges.first().expect("the acquire").sent,
        SlotVanish::ProcessKilled => last.sent,
    };
    let contender = slot_backend(azurite.port());
    let (next, start) = poll_for_slot(&contender, &key).await;
    assert!(
        start + Duration::from_millis(100) >= lease_taken + LEASE,
        "the slot was taken {:?} before its lease could have run out",
        (lease_taken + LEASE) - start
    );
    // Polling every 100 ms, two or three requests per attempt, on a loaded machine.
    assert_near(
        "the next holder of the vanished slot",
        start,
        last.answered + LEASE,
        LEASE,
        Duration::from_millis(1500),
    );
    assert_eq!(slot_of(&next), vanished_slot);
    assert!(next.fencing_token() > vanished_token);
    for task in &renewing {
        assert!(!task.is_finished(), "a keeper lost its slot");
    }
    for task in renewing {
        task.abort();
    }
    for (backend, lease) in keepers.iter().zip(&kept) {
        backend.renew(lease).await.expect("the keepers still hold");
        backend.release(lease).await.expect("release");
    }
    contender.release(&next).await.expect("release");
}

/// Takes a slot through `DistributedLock::semaphore` in a separate OS process (this test
/// binary, running [`vanishing_slot_holder_process`]), whose engine renews it until killed.
async fn slot_holder_process(port: u16, key: &str) -> (ChildGuard, u32, u64) {
    let mut child = this_test_again(module_path!(), "vanishing_slot_holder_process")
        .env(CHILD_SLOT_PORT, port.to_string())
        .env(CHILD_SLOT_KEY, key)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the slot holder process");
    let stdout = child.stdout.take().expect("piped stdout");
    let guard = ChildGuard(child);
    let held = tokio::time::timeout(
        PATIENCE,
        tokio::task::spawn_blocking(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(held) = line.strip_prefix("HELD SLOT ") {
                    let (slot, token) = held.trim().split_once(' ')?;
                    return Some((slot.parse::<u32>().ok()?, token.parse::<u64>().ok()?));
                }
            }
            None
        }),
    )
    .await
    .expect("the slot holder reports its slot")
    .expect("the reading task")
    .expect("the slot holder took a slot");
    (guard, held.0, held.1)
}

/// Not a case of its own: the slot holder process that
/// [`vanished_slot_holder`] starts and kills. It does nothing unless started by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "started as a separate process by the vanishing slot holder case"]
async fn vanishing_slot_holder_process() {
    let (Ok(port), Ok(key)) = (
        std::env::var(CHILD_SLOT_PORT),
        std::env::var(CHILD_SLOT_KEY),
    ) else {
        return;
    };
    let handle = lock_through(Kind::Azure, port.parse().expect("a port"))
        .semaphore(&key, 3)
        .expect("a semaphore of three")
        .acquire(PATIENCE)
        .await
        .expect("the slot holder process acquires");
    let lease = handle.azure_blob_lease().expect("an Azure lease");
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "HELD SLOT {} {}",
            slot_of(&lease),
            handle.fencing_token()
        )
        .expect("report");
        out.flush().expect("flush");
    }
    // The engine renews the slot until the process is killed.
    tokio::time::sleep(Duration::from_secs(600)).await;
    drop(handle);
}

// ----------------------------------------------------------------------------------------------
// The cases, per backend
// ----------------------------------------------------------------------------------------------

mod postgres {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_server_loses_the_lock_within_a_check_and_recovers() {
        killed_backend(Server::postgres().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn paused_server_loses_the_lock_when_a_check_times_out() {
        paused_backend(Server::postgres().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn restart_under_twenty_waiters_from_four_processes_never_overlaps() {
        restarted_under_waiters(Server::postgres().await).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn terminated_session_is_lost_within_a_check_and_the_lock_moves_on() {
        let server = Server::postgres().await;
        let Server::Postgres(pg) = &server else {
            unreachable!()
        };
        let key = unique_prefix("chaos/terminated");
        let checker = IntervalChecker::new();
        let (holder, other) = (server.process(0).await, server.process(1).await);
        let watched = holder.hold_watched(&key).await;
        settle(server.kind(), &holder, &watched).await;
        let contender = other.wait_through_outages_for(&key);
        let holder_token = watched.token;
        let terminated = Instant::now();
        assert_eq!(pg.terminate_lock_holders(&key).await, 1);

        let (loss, _) = watched.lost_within(PATIENCE).await;
        assert_lost(&loss, LossReason::ConnectionLost);
        assert_near(
            "loss",
            loss.at,
            terminated,
            Duration::ZERO,
            CHECK + POSTGRES_LATE,
        );
        let error = loss.handle.release().await.expect_err("a lost lock");
        assert_eq!(error.kind(), ErrorKind::Lost);

        let (handle, start) = contender_lock(contender).await;
        assert_session_handover(terminated, loss.at, start);
        assert!(handle.fencing_token() > holder_token);
        let token = handle.fencing_token();
        record(&checker, &key, other.id, token, start);
        handle.release().await.expect("release");
        holder.usable_again(&key, &checker, token).await;
        checker.assert_consistent();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fencing_refuses_the_old_holders_late_write_after_its_session_ended() {
        let server = Server::postgres().await;
        let Server::Postgres(pg) = &server else {
            unreachable!()
        };
        // A resource that enforces fencing: a write carries its writer's token and is
        // accepted only above the highest token the resource has seen.
        let resource = pg.connect().await;
        resource
            .batch_execute(
                "CREATE TABLE fenced_resource (id int PRIMARY KEY, token bigint NOT NULL, writer text NOT NULL); \
                 INSERT INTO fenced_resource VALUES (1, 0, 'nobody');",
            )
            .await
            .expect("the resource");
        let write = async |token: u64, writer: &str| -> u64 {
            let token = i64::try_from(token).expect("a token fits a bigint");
            resource
                .execute(
                    "UPDATE fenced_resource SET token = $1, writer = $2 WHERE id = 1 AND token < $1",
                    &[&token, &writer],
                )
                .await
                .expect("a write")
        };
        let key = unique_prefix("chaos/fenced");
        let (holder, other) = (server.process(0).await, server.process(1).await);
        let old = holder.locks.try_acquire(&key).await.expect("lock");
        assert_eq!(
            write(old.fencing_token(), "old").await,
            1,
            "the holder writes"
        );

        // The holder's session ends under it (a failover, a kill, an operator), and another
        // process takes the lock, as it may before the holder can know.
        assert_eq!(pg.terminate_lock_holders(&key).await, 1);
        let (new, _) = contender_lock(other.wait_through_outages_for(&key)).await;
        assert!(new.fencing_token() > old.fencing_token());
        assert_eq!(
            write(new.fencing_token(), "new").await,
            1,
            "the new holder writes"
        );

        // The old holder's work was already under way with the token it was given: its late
        // write is refused by the resource, whatever the old holder believed.
        assert_eq!(write(old.fencing_token(), "old, late").await, 0);
        let row = resource
            .query_one(
                "SELECT token, writer FROM fenced_resource WHERE id = 1",
                &[],
            )
            .await
            .expect("the resource");
        assert_eq!(row.get::<_, String>(1), "new");
        tokio::time::timeout(PATIENCE, old.lost_token().cancelled())
            .await
            .expect("the old holder learns of the loss");
        assert_eq!(old.ensure_held().unwrap_err().kind(), ErrorKind::Lost);
        new.release().await.expect("release");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blackholed_line_loses_the_lock_when_a_check_times_out() {
        proxy_fault(Server::postgres().await, Fault::Blackhole).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reset_line_loses_the_lock_within_a_check() {
        proxy_fault(Server::postgres().await, Fault::Reset).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_holder_process_frees_the_lock_when_its_connection_closes() {
        vanished_holder(Server::postgres().await, Vanish::ProcessKilled).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_holder_runtime_frees_the_lock_when_its_connection_closes() {
        vanished_holder(Server::postgres().await, Vanish::RuntimeDropped).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn latency_of_200ms_causes_no_false_loss() {
        slow_network(Server::postgres().await).await;
    }
}

mod azure {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_server_loses_the_lock_at_the_deadline_and_recovers() {
        let server = Server::azure(Persistence::OnDisk).await;
        killed_backend(server).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn paused_server_loses_the_lock_at_the_deadline() {
        let server = Server::azure(Persistence::InMemory).await;
        paused_backend(server).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn restart_under_twenty_waiters_from_four_processes_never_overlaps() {
        // On disk, so fencing tokens survive the restart.
        let server = Server::azure(Persistence::OnDisk).await;
        restarted_under_waiters(server).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lease_broken_by_another_client_is_lost_at_the_next_renewal() {
        let server = Server::azure(Persistence::InMemory).await;
        let Server::Azure(azurite) = &server else {
            unreachable!()
        };
        let key = unique_prefix("chaos/broken");
        let (holder, other) = (server.process(0).await, server.process(1).await);
        let watched = holder.hold_watched(&key).await;
        let renewal = tokio::time::timeout(
            RENEW_EVERY * 2,
            holder.proxy.exchange_after(watched.acquired),
        )
        .await
        .expect("a renewal");
        let holder_token = watched.token;
        azurite
            .plain_container_client("locks")
            .blob_client(&AzureLockKeys::guard_blob_name(&key))
            .break_lease(Some(BlobClientBreakLeaseOptions {
                break_period: Some(0),
                ..Default::default()
            }))
            .await
            .expect("a plain SDK client breaks the lease");
        let broken = Instant::now();
        let contender = other.wait_through_outages_for(&key);

        let (loss, _) = watched.lost_within(PATIENCE).await;
        assert_lost(&loss, LossReason::LeaseGone);
        // The next renewal is due 5 s after the last one was sent, which was no later than the
        // proxy read it; it is told at once that the lease is broken.
        assert!(loss.at > broken);
        assert_near(
            "loss",
            loss.at,
            renewal.sent + RENEW_EVERY,
            SEND_SKEW,
            AZURE_LATE,
        );
        assert!(
            loss.at < renewal.sent + LEASE * 9 / 10,
            "never at the deadline"
        );

        // Breaking a lease is an operator overriding the lock: the contender may take it at
        // once, while the holder only learns at its next renewal. That window is at most one
        // renewal period, and the fencing token is what protects the resource in it.
        let (handle, start) = contender_lock(contender).await;
        assert!(handle.fencing_token() > holder_token);
        if start < loss.at {
            assert!(loss.at - start <= RENEW_EVERY + AZURE_LATE);
        }
        let checker = IntervalChecker::new();
        record(&checker, &key, other.id, handle.fencing_token(), start);
        let token = handle.fencing_token();
        handle.release().await.expect("release");
        holder.usable_again(&key, &checker, token).await;
        checker.assert_consistent();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn blackholed_line_loses_the_lock_at_the_deadline() {
        let server = Server::azure(Persistence::InMemory).await;
        proxy_fault(server, Fault::Blackhole).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reset_line_loses_the_lock_at_the_deadline() {
        let server = Server::azure(Persistence::InMemory).await;
        proxy_fault(server, Fault::Reset).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_holder_process_frees_the_lock_when_the_lease_runs_out() {
        let server = Server::azure(Persistence::InMemory).await;
        vanished_holder(server, Vanish::ProcessKilled).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropped_holder_runtime_frees_the_lock_when_the_lease_runs_out() {
        let server = Server::azure(Persistence::InMemory).await;
        vanished_holder(server, Vanish::RuntimeDropped).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn latency_of_200ms_causes_no_false_loss() {
        let server = Server::azure(Persistence::InMemory).await;
        slow_network(server).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn broken_lease_on_one_semaphore_slot_is_that_holders_loss_only() {
        let azurite = Azurite::start_local(Persistence::InMemory).await;
        broken_slot_lease(&azurite).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn broken_semaphore_slot_lease_loses_only_that_handle() {
        let server = Server::azure(Persistence::InMemory).await;
        broken_slot_lease_through_the_engine(server).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn semaphore_slot_left_to_expire_is_free_when_its_lease_runs_out_and_not_before() {
        let azurite = Azurite::start_local(Persistence::InMemory).await;
        vanished_slot_holder(&azurite, SlotVanish::LeaseLeft).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_semaphore_slot_holder_frees_its_slot_when_the_lease_runs_out() {
        let azurite = Azurite::start_local(Persistence::InMemory).await;
        vanished_slot_holder(&azurite, SlotVanish::ProcessKilled).await;
    }
}

/// The in-memory provider's own faults, on paused time: the same rules, measured exactly.
mod memory {
    use super::*;
    use lockingkit::providers::memory::RenewalFault;
    use lockingkit::{MemoryBackend, MemoryStore};

    /// The in-memory provider's default lease.
    const MEMORY_LEASE: Duration = Duration::from_secs(30);

    fn process(store: &MemoryStore) -> DistributedLock {
        DistributedLock::builder(MemoryBackend::with_lease(store.clone(), MEMORY_LEASE))
            .options(quick_polling())
            .build()
            .expect("valid options")
    }

    /// Holds a lock past its first renewal (at 10 s), injects `fault` at 15 s, and returns the
    /// loss with the instant the lock was acquired.
    async fn hold_then(store: &MemoryStore, key: &str, fault: impl FnOnce()) -> (Loss, Instant) {
        let holder = process(store);
        let handle = holder.try_acquire(key).await.expect("acquire");
        let acquired = Instant::now();
        let watched = Watched::new(0, handle, acquired);
        tokio::time::sleep(Duration::from_secs(15)).await;
        assert_eq!(store.renewals(), 1);
        fault();
        let (loss, _) = watched.lost_within(Duration::from_secs(120)).await;
        (loss, acquired)
    }

    #[tokio::test(start_paused = true)]
    async fn unavailable_store_is_lost_27s_after_the_last_renewal_and_waiters_see_unavailable() {
        let store = MemoryStore::new();
        let key = "chaos/memory/down";
        let other = process(&store);
        let (loss, acquired) = hold_then(&store, key, || store.set_unavailable(true)).await;
        assert_lost(&loss, LossReason::Deadline);
        assert_eq!(loss.at - acquired, Duration::from_secs(10 + 27));
        let error = other
            .acquire(key, Duration::from_secs(2))
            .await
            .expect_err("down");
        assert_eq!(error.kind(), ErrorKind::Unavailable);
        store.set_unavailable(false);
        // Callers are refused with the outage's cause until the gate's next probe, at most
        // `max_outage_retry_delay` (1 s) after the last failure, finds the store back.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let handle = other
            .acquire(key, Duration::from_secs(10))
            .await
            .expect("after recovery");
        // The store kept the lease until 30 s after the last renewal.
        assert!(Instant::now() - acquired >= Duration::from_secs(40));
        assert!(handle.fencing_token() > loss.handle.fencing_token());
    }

    #[tokio::test(start_paused = true)]
    async fn hung_renewals_are_lost_27s_after_the_last_renewal_was_sent() {
        let store = MemoryStore::new();
        let key = "chaos/memory/hang";
        let other = process(&store);
        let (loss, acquired) =
            hold_then(&store, key, || store.set_renewal_fault(RenewalFault::Hang)).await;
        assert_lost(&loss, LossReason::Deadline);
        assert_eq!(loss.at - acquired, Duration::from_secs(10 + 27));
        store.set_renewal_fault(RenewalFault::None);
        let handle = other
            .acquire(key, Duration::from_secs(10))
            .await
            .expect("after the lease");
        assert!(handle.fencing_token() > loss.handle.fencing_token());
    }

    #[tokio::test(start_paused = true)]
    async fn broken_lease_is_lost_at_the_next_renewal() {
        let store = MemoryStore::new();
        let key = "chaos/memory/broken";
        let (loss, acquired) = hold_then(&store, key, || assert!(store.break_lease(key))).await;
        assert_lost(&loss, LossReason::LeaseGone);
        assert_eq!(loss.at - acquired, Duration::from_secs(20));
    }
}
