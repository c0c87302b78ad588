//! The outage experiment, against a real PostgreSQL server: two locked axum routes per account
//! (deposits make one attempt per request, transfers wait up to 2 s) and an unlocked control
//! route under sixty-four clients while the server is frozen, unreachable, restarted, or
//! refuses our password.
//!
//! What a careful operator needs from it, and what each test checks:
//! - an outage is never answered as contention: once the fault is older than the engine's
//!   patience (2 s), no request gets `409`; every refusal is `503` (`500` when the server
//!   refuses our credentials);
//! - an outage is answered at once: from then on, 99% of the requests of either route, waiting
//!   ones included, are answered within 50 ms, or (on a machine busy with other work) no slower
//!   than twice the 99th percentile of an unlocked control route that the same server answers
//!   at the same time: a refusal is local work, as that route's answer is, and one that waited
//!   for the probe's timeout (a second or more) fails either way;
//! - the server is asked again within 900 ms of its return (the provider gate's longest pause
//!   between probes; later only by the machine's own answer time), and service resumes — on an
//!   idle machine within a second, the reconnect included;
//! - the server is not hammered: the connections it sees (counted by a proxy in front of it, or
//!   as failed logins in its log) stay a handful however many requests arrive;
//! - the log is not flooded: a handful of warnings for the whole outage, not one per request;
//! - service resumes once the fault ends.
//!
//! Each test prints its counts (`--nocapture`), the numbers the closing note of the issue
//! quotes. The tests take the machine for a few seconds each, so they run one at a time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use http::StatusCode;
use lockingkit::{DistributedLock, PostgresBackend};
use lockingkit_tests::http::{serve, Connection};
use lockingkit_tests::postgres::PostgresServer;
use lockingkit_tests::proxy::{Fault, FaultProxy};
use tokio::time::Instant;

/// Runs one experiment at a time, even when the test harness runs them in one process.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The engine's patience: an attempt unanswered this long is an outage, and from then on the
/// gate refuses callers at once (`LockOptions::max_retry_delay`, and at least 2 s).
const PATIENCE: Duration = Duration::from_secs(2);

/// How soon a request is answered while the backend is known to be failing: 99% of them, on an
/// idle machine. On a loaded one the bound is twice the control route's p99 in the same window
/// (see [`Run::at_once`]).
const ANSWERED_AT_ONCE: Duration = Duration::from_millis(50);

/// How soon after the server's return the library asks it again: the provider gate's longest
/// pause between two probes (`health::OUTAGE_MOST`, 900 ms), the last failed one coming before
/// the return. What the reconnect then takes (a server process forked, a login, the lock) is
/// the machine's speed, not the library's: on an idle machine service resumes within a second
/// of the return, and the printout shows it.
const PROBED_WITHIN: Duration = Duration::from_millis(900);

const CLIENTS: usize = 64;
const ACCOUNTS: usize = 8;

/// Warnings and errors logged by anyone in this process, counted since it started.
#[derive(Default)]
struct Lines {
    warnings: AtomicUsize,
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for &'static Lines {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() <= tracing::Level::WARN {
            self.warnings.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn lines() -> &'static Lines {
    static LINES: OnceLock<&'static Lines> = OnceLock::new();
    LINES.get_or_init(|| {
        use tracing_subscriber::layer::SubscriberExt;
        let lines: &'static Lines = Box::leak(Box::default());
        let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry().with(lines));
        lines
    })
}

/// One answer, and when its request was sent and answered.
struct Answer {
    sent: Instant,
    answered: Instant,
    status: StatusCode,
    route: Route,
}

/// The routes the clients post to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    /// One attempt at the account's lock.
    Deposits,
    /// Waits up to 2 s for the account's lock.
    Transfers,
    /// No lock: what the machine and the server take to answer a request at that moment.
    Control,
}

impl Route {
    /// One client in eight transfers and one posts to the control route: a waiting route and
    /// an unlocked one beside the others.
    fn of_client(client: usize) -> Route {
        match client % 8 {
            7 => Route::Transfers,
            3 => Route::Control,
            _ => Route::Deposits,
        }
    }

    fn path(self, account: usize) -> String {
        match self {
            Route::Deposits => format!("/accounts/{account}/deposits"),
            Route::Transfers => format!("/accounts/{account}/transfers"),
            Route::Control => "/control".to_owned(),
        }
    }
}

/// `POST /accounts/{id}/deposits` behind `lock_route("accounts/{id}")` on `locks`,
/// `POST /accounts/{id}/transfers` behind the same lock waiting up to 2 s, and `POST /control`
/// without a lock: the handlers themselves take no time.
fn deposits(locks: DistributedLock) -> Router {
    Router::new()
        .route("/control", post(|| async { StatusCode::OK }))
        .route(
            "/accounts/{id}/deposits",
            post(|| async { StatusCode::OK })
                .route_layer(lockingkit_axum::lock_route(locks.clone(), "accounts/{id}")),
        )
        .route(
            "/accounts/{id}/transfers",
            post(|| async { StatusCode::OK }).route_layer(lockingkit_axum::lock_route_waiting(
                locks,
                "accounts/{id}",
                Duration::from_secs(2),
            )),
        )
}

/// Sixty-four clients, each on a keep-alive connection, posting deposits to one of eight
/// accounts until `stop`; every answer is recorded.
struct Clients {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Answer>>>,
}

impl Clients {
    async fn start(locks: DistributedLock) -> Clients {
        let addr = serve(deposits(locks)).await;
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..CLIENTS)
            .map(|client| {
                let stop = stop.clone();
                tokio::spawn(async move {
                    let mut connection = Connection::open(addr).await;
                    let route = Route::of_client(client);
                    let path = route.path(client % ACCOUNTS);
                    let mut answers = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let sent = Instant::now();
                        let status = connection.post(&path).await;
                        let answered = Instant::now();
                        answers.push(Answer {
                            sent,
                            answered,
                            status,
                            route,
                        });
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                    answers
                })
            })
            .collect();
        Clients { stop, tasks }
    }

    async fn stop(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for task in self.tasks {
            all.extend(task.await.expect("a client task panicked"));
        }
        all
    }
}

/// The 99th percentile and the longest of the times to answer the requests of `route` sent and
/// answered in `[from, to)`.
fn latencies(answers: &[Answer], route: Route, from: Instant, to: Instant) -> (Duration, Duration) {
    let mut times: Vec<Duration> = answers
        .iter()
        .filter(|a| a.route == route && a.sent >= from && a.answered < to)
        .map(|a| a.answered - a.sent)
        .collect();
    times.sort();
    let p99 = times
        .get(times.len().saturating_mul(99) / 100)
        .copied()
        .unwrap_or_default();
    (p99, times.last().copied().unwrap_or_default())
}

/// How long after `from` the first request of a locked route answered 200 was answered.
fn first_success_after(answers: &[Answer], from: Instant) -> Option<Duration> {
    answers
        .iter()
        .filter(|a| a.route != Route::Control)
        .filter(|a| a.status == StatusCode::OK && a.answered >= from)
        .map(|a| a.answered - from)
        .min()
}

/// How long after `from` a request first reached the server through `proxy`.
fn first_request_after(proxy: &FaultProxy, from: Instant) -> Option<Duration> {
    proxy
        .exchanges()
        .iter()
        .filter(|exchange| exchange.sent >= from)
        .map(|exchange| exchange.sent - from)
        .min()
}

/// How many answers of each status came back for requests to the locked routes sent and
/// answered in `[from, to)`.
fn statuses(answers: &[Answer], from: Instant, to: Instant) -> BTreeMap<u16, usize> {
    let mut counts = BTreeMap::new();
    let locked = answers.iter().filter(|a| a.route != Route::Control);
    for answer in locked.filter(|a| a.sent >= from && a.answered < to) {
        *counts.entry(answer.status.as_u16()).or_insert(0) += 1;
    }
    counts
}

fn locks_through(proxy: &FaultProxy, server: &PostgresServer) -> DistributedLock {
    let options = server
        .options(Duration::from_secs(5))
        .with_connection_string(format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
            proxy.port()
        ));
    DistributedLock::builder(PostgresBackend::new(options).expect("options"))
        .build()
        .expect("lock options")
}

/// What a fault did, for the assertions and the printout.
struct Run {
    /// Answers to requests sent once the fault was older than the engine's patience.
    during: BTreeMap<u16, usize>,
    /// Answers to requests sent in the second after the fault began.
    first_second: BTreeMap<u16, usize>,
    /// Answers to requests sent from `recovered_by` after the fault ended.
    after: BTreeMap<u16, usize>,
    /// The 99th percentile and the longest time to answer, once the fault was older than the
    /// patience, for the route that makes one attempt and the one that waits.
    one_attempt: (Duration, Duration),
    waiting: (Duration, Duration),
    /// The control route's 99th percentile and longest time, in the same window.
    control: (Duration, Duration),
    /// How long after the server's return the first request succeeded.
    resumed_after: Option<Duration>,
    /// How long after the server's return a request first reached it (the reconnect's first).
    probed_after: Option<Duration>,
    connections: usize,
    warnings: usize,
}

impl Run {
    fn print(&self, fault: &str) {
        let answered: usize = self.during.values().sum();
        eprintln!(
            "{fault}: after the patience {:?} ({answered} answers); first {PATIENCE:?} {:?}; \
             after recovery {:?}; control route p99 {:?} max {:?}; one-attempt route p99 {:?} \
             max {:?}; waiting route p99 {:?} max {:?}; server asked again {:?} and first success \
             {:?} after the return; {} connections reached the server; {} warning lines",
            self.during,
            self.first_second,
            self.after,
            self.control.0,
            self.control.1,
            self.one_attempt.0,
            self.one_attempt.1,
            self.waiting.0,
            self.waiting.1,
            self.probed_after,
            self.resumed_after,
            self.connections,
            self.warnings
        );
    }

    /// How soon "at once" is in this run: [`ANSWERED_AT_ONCE`], or twice the control route's
    /// p99 in the same window when the machine made even unlocked answers slower than that. A
    /// refusal is local work, as the control route's answer is.
    fn at_once(&self) -> Duration {
        ANSWERED_AT_ONCE.max(self.control.0.saturating_mul(2))
    }

    /// Once the gate knows, every route's refusals come at once, and service resumes within a
    /// second of the server's return.
    fn assert_answered_at_once_and_resumed(&self) {
        let at_once = self.at_once();
        assert!(
            self.one_attempt.0 <= at_once,
            "one-attempt route: p99 {:?} (at once: {at_once:?})",
            self.one_attempt.0
        );
        assert!(
            self.waiting.0 <= at_once,
            "waiting route: p99 {:?} (at once: {at_once:?})",
            self.waiting.0
        );
        // The probe's timer is late by what the machine takes to answer anything (at_once).
        let probed = self.probed_after.expect("the server was asked again");
        assert!(
            probed <= PROBED_WITHIN + at_once,
            "the server was first asked {probed:?} after its return (bound {PROBED_WITHIN:?} \
             and {at_once:?})"
        );
        assert!(self.resumed_after.is_some(), "service never resumed");
    }

    fn assert_outage_is_503_never_409(&self) {
        assert_eq!(self.during.get(&409), None, "an outage is not contention");
        assert!(
            self.during.keys().all(|status| *status == 503),
            "every refusal is 503: {:?}",
            self.during
        );
        assert!(
            self.during.get(&503).copied().unwrap_or(0) > 100,
            "{:?}",
            self.during
        );
        assert!(
            self.after.get(&200).copied().unwrap_or(0) > 100,
            "service resumes: {:?}",
            self.after
        );
    }
}

/// The faults of the experiment.
#[derive(Clone, Copy)]
enum Outage {
    /// Every server process stopped (SIGSTOP): connections stay open and nothing answers.
    Frozen,
    /// The network resets every connection, open and new.
    Unreachable,
    /// The server stopped (every session ends), started again when the outage ends.
    Restarted,
}

impl Outage {
    async fn begin(self, server: &mut PostgresServer, proxy: &FaultProxy) {
        match self {
            Outage::Frozen => server.pause(),
            Outage::Unreachable => proxy.set_fault(Fault::Reset),
            Outage::Restarted => server.stop_immediate(),
        }
    }

    async fn end(self, server: &mut PostgresServer, proxy: &FaultProxy) {
        match self {
            Outage::Frozen => server.resume(),
            Outage::Unreachable => proxy.set_fault(Fault::Pass),
            Outage::Restarted => server.start_again().await,
        }
    }
}

/// Runs the clients for a second, applies `outage` for `length`, ends it, and runs on until
/// `recovered_by` after the end plus two more seconds.
async fn experiment(outage: Outage, length: Duration, recovered_by: Duration) -> Run {
    lines();
    let mut server = PostgresServer::start_local().await;
    let proxy = FaultProxy::to_port(server.port()).await;
    let locks = locks_through(&proxy, &server);
    let clients = Clients::start(locks.clone()).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (connections, warnings) = (
        proxy.connections_accepted(),
        lines().warnings.load(Ordering::SeqCst),
    );
    let began = Instant::now();
    outage.begin(&mut server, &proxy).await;
    tokio::time::sleep(length).await;
    outage.end(&mut server, &proxy).await;
    // The server is back (a restarted one accepts connections again) from here.
    let ended = Instant::now();
    let connections = proxy.connections_accepted() - connections;
    let warnings = lines().warnings.load(Ordering::SeqCst) - warnings;
    tokio::time::sleep(recovered_by + Duration::from_secs(2)).await;
    let answers = clients.stop().await;
    let during = began + PATIENCE;
    Run {
        during: statuses(&answers, during, ended),
        first_second: statuses(&answers, began, during),
        after: statuses(&answers, ended + recovered_by, Instant::now()),
        one_attempt: latencies(&answers, Route::Deposits, during, ended),
        waiting: latencies(&answers, Route::Transfers, during, ended),
        control: latencies(&answers, Route::Control, during, ended),
        resumed_after: first_success_after(&answers, ended),
        probed_after: first_request_after(&proxy, ended),
        connections,
        warnings,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_server_is_503_to_every_request_never_409() {
    let _one = ONE_AT_A_TIME.lock().await;
    // Frozen longer than the statement timeout (5 s), so attempts time out while it lasts.
    let run = experiment(
        Outage::Frozen,
        Duration::from_secs(6),
        Duration::from_secs(6),
    )
    .await;
    run.print("frozen 6 s");
    run.assert_outage_is_503_never_409();
    run.assert_answered_at_once_and_resumed();
    assert!(run.warnings <= 20, "{} warnings", run.warnings);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_is_503_and_reconnects_back_off() {
    let _one = ONE_AT_A_TIME.lock().await;
    let run = experiment(
        Outage::Unreachable,
        Duration::from_secs(5),
        Duration::from_secs(6),
    )
    .await;
    run.print("unreachable 5 s");
    run.assert_outage_is_503_never_409();
    run.assert_answered_at_once_and_resumed();
    // One connect at a time, 100 ms after a failure and doubling: at most eight in 5 s for the
    // lock sessions, whatever the request rate.
    assert!(run.connections <= 12, "{} connections", run.connections);
    assert!(run.warnings <= 20, "{} warnings", run.warnings);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_nobody_holding_a_lock_is_never_answered_409() {
    let _one = ONE_AT_A_TIME.lock().await;
    let run = experiment(
        Outage::Restarted,
        Duration::from_secs(3),
        Duration::from_secs(6),
    )
    .await;
    run.print("restarted, down 3 s");
    run.assert_outage_is_503_never_409();
    run.assert_answered_at_once_and_resumed();
    assert!(run.connections <= 12, "{} connections", run.connections);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_password_is_500_to_every_request_at_a_handful_of_logins() {
    let _one = ONE_AT_A_TIME.lock().await;
    let server = PostgresServer::start_local().await;
    let wrong = server.create_password_role("right", "wrong").await;
    let options = server
        .options(Duration::from_secs(5))
        .with_connection_string(wrong);
    let locks = DistributedLock::builder(PostgresBackend::new(options).expect("options"))
        .build()
        .expect("lock options");
    let warnings = lines().warnings.load(Ordering::SeqCst);
    let began = Instant::now();
    let clients = Clients::start(locks).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let answers = clients.stop().await;
    let statuses = statuses(&answers, began, Instant::now());
    let logins = server
        .server_log()
        .matches("password authentication failed")
        .count();
    let warnings = lines().warnings.load(Ordering::SeqCst) - warnings;
    eprintln!("wrong password 5 s: {statuses:?}; {logins} failed logins; {warnings} warning lines");
    assert!(statuses.keys().all(|status| *status == 500), "{statuses:?}");
    assert!(
        statuses.get(&500).copied().unwrap_or(0) > 1000,
        "{statuses:?}"
    );
    assert!(logins <= 10, "{logins} failed logins in 5 s");
    assert!(warnings <= 2, "{warnings} warnings");
}

/// An Azure provider whose requests go through `proxy` to Azurite, with `key` as its account
/// key (`None`: the right one).
fn azure_through(
    proxy: &FaultProxy,
    azurite: &lockingkit_tests::azurite::Azurite,
    key: Option<&str>,
) -> DistributedLock {
    let right = azurite.connection_string();
    let connection = right.replace(
        &format!("127.0.0.1:{}", azurite.port()),
        &format!("127.0.0.1:{}", proxy.port()),
    );
    let connection = match key {
        Some(key) => connection.replace(
            connection
                .split(';')
                .find_map(|part| part.strip_prefix("AccountKey="))
                .unwrap_or_default(),
            key,
        ),
        None => connection,
    };
    let backend = lockingkit::AzureBlobBackend::new(
        lockingkit::AzureBlobOptions::from_connection_string(connection)
            .with_lease_duration(Duration::from_secs(15))
            .with_request_timeout(Duration::from_secs(2)),
    )
    .expect("options");
    DistributedLock::builder(backend)
        .build()
        .expect("lock options")
}

/// Sixty-four callers of `try_acquire` on eight keys for `length`; the kinds of every answer.
async fn callers_for(locks: &DistributedLock, length: Duration) -> BTreeMap<String, usize> {
    let until = Instant::now() + length;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let locks = locks.clone();
            tokio::spawn(async move {
                let key = format!("accounts/{}", client % ACCOUNTS);
                let mut kinds = Vec::new();
                while Instant::now() < until {
                    match locks.try_acquire(&key).await {
                        Ok(handle) => {
                            let _ = handle.release().await;
                            kinds.push("acquired".to_owned());
                        }
                        Err(error) => kinds.push(error.code().to_owned()),
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                kinds
            })
        })
        .collect();
    let mut counts = BTreeMap::new();
    for task in tasks {
        for kind in task.await.expect("a caller panicked") {
            *counts.entry(kind).or_insert(0) += 1;
        }
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_azure_credential_costs_the_service_a_handful_of_requests() {
    let _one = ONE_AT_A_TIME.lock().await;
    lines();
    let azurite = lockingkit_tests::azurite::Azurite::start_local(
        lockingkit_tests::azurite::Persistence::InMemory,
    )
    .await;
    let proxy = FaultProxy::to_port(azurite.port()).await;
    let locks = azure_through(
        &proxy,
        &azurite,
        Some("d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXk="),
    );
    let warnings = lines().warnings.load(Ordering::SeqCst);
    let kinds = callers_for(&locks, Duration::from_secs(5)).await;
    let requests = proxy.exchanges().len();
    let warnings = lines().warnings.load(Ordering::SeqCst) - warnings;
    eprintln!("azure, wrong key 5 s: {kinds:?}; {requests} requests reached the service; {warnings} warning lines");
    assert!(
        kinds.keys().all(|kind| kind == "locking.misconfigured"),
        "{kinds:?}"
    );
    assert!(kinds.values().sum::<usize>() > 1000, "{kinds:?}");
    // The eight keys' first attempts, then one probe at a time (a request each; retries are
    // for transient failures only).
    assert!(requests <= 8 + 8, "{requests} requests in 5 s");
    assert!(warnings <= 2, "{warnings} warnings");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_azure_service_is_unavailable_and_not_hammered() {
    let _one = ONE_AT_A_TIME.lock().await;
    lines();
    let azurite = lockingkit_tests::azurite::Azurite::start_local(
        lockingkit_tests::azurite::Persistence::InMemory,
    )
    .await;
    let proxy = FaultProxy::to_port(azurite.port()).await;
    let locks = azure_through(&proxy, &azurite, None);
    locks
        .try_acquire("warm-up")
        .await
        .expect("Azurite answers")
        .release()
        .await
        .expect("release");
    proxy.set_fault(Fault::Reset);
    let connections = proxy.connections_accepted();
    let kinds = callers_for(&locks, Duration::from_secs(5)).await;
    let connections = proxy.connections_accepted() - connections;
    eprintln!("azure, unreachable 5 s: {kinds:?}; {connections} connections reached the proxy");
    assert!(
        kinds.keys().all(|kind| kind == "locking.unavailable"),
        "{kinds:?}"
    );
    // At most fifteen attempts in 5 s (the eight keys' first ones, then one probe at a time),
    // each sent up to three times by the provider's own retry policy (max_retries 2), and a
    // connection reset before the request is written may be retried once by the HTTP client.
    assert!(
        connections <= 15 * 3 * 2,
        "{connections} connections in 5 s"
    );
}
