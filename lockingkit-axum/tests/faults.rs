//! What a locked route answers when things go wrong around it: a lock lost while the handler's
//! write is in flight (the outcome is unknown, and with `OnLoss::Signal` the handler decides),
//! and wiring mistakes in the server (two layers locking one key, a template naming a parameter
//! the route does not capture), which are 500s logged once, not 409s or 400s on every request.

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use http::StatusCode;
use lockingkit::{DistributedLock, LockMode, MemoryStore};
use lockingkit_axum::{lock_route, HeldLock};
use lockingkit_tower::OnLoss;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;

use support::{guarded, post as http_post, serve, short_lease_locks, Reply};

/// A "database" that applies a write once it is sent, whether or not the caller is still
/// there to hear back — as a server commits a statement whose client future was dropped.
#[derive(Clone)]
struct Database {
    applied: Arc<watch::Sender<usize>>,
}

impl Default for Database {
    fn default() -> Self {
        Self {
            applied: Arc::new(watch::channel(0).0),
        }
    }
}

impl Database {
    /// Sends the write; it is applied when `commit` fires, and the answer comes back then.
    async fn write(&self, commit: oneshot::Receiver<()>) {
        let applied = self.applied.clone();
        let server = tokio::spawn(async move {
            let _ = commit.await;
            applied.send_modify(|applied| *applied += 1);
        });
        let _ = server.await;
    }

    fn applied(&self) -> usize {
        *self.applied.borrow()
    }

    /// Returns once `writes` writes are applied.
    async fn until_applied(&self, writes: usize) {
        let mut applied = self.applied.subscribe();
        guarded(applied.wait_for(|applied| *applied >= writes))
            .await
            .expect("the database is still there");
    }
}

/// A route whose handler sends one write and waits for it; it reports when the write is in
/// flight and hands the test the switch that lets the database apply it.
fn deposit_route(
    locks: DistributedLock,
    database: Database,
    on_loss: OnLoss,
) -> (Router, mpsc::UnboundedReceiver<oneshot::Sender<()>>) {
    let (in_flight_tx, in_flight) = mpsc::unbounded_channel();
    let handler = move |lock: HeldLock| {
        let (database, in_flight_tx) = (database.clone(), in_flight_tx.clone());
        async move {
            let (commit, committed) = oneshot::channel();
            let _ = in_flight_tx.send(commit);
            database.write(committed).await;
            // With `OnLoss::Signal` the handler gets here and tells the truth itself.
            match lock.ensure_held() {
                Ok(()) => (StatusCode::OK, "deposited"),
                Err(_) => (
                    StatusCode::ACCEPTED,
                    "deposited; the lock was lost meanwhile",
                ),
            }
        }
    };
    let app = Router::new().route(
        "/accounts/{id}/deposits",
        post(handler).route_layer(lock_route(locks, "accounts/{id}").on_loss(on_loss)),
    );
    (app, in_flight)
}

/// A deposit whose write is in flight when the test breaks its lock's lease.
struct LostMidWrite {
    database: Database,
    request: JoinHandle<Reply>,
    /// Lets the database apply the write.
    commit: oneshot::Sender<()>,
}

/// Serves the deposit route with `on_loss`, sends a deposit to `account`, and breaks the lease
/// of its lock once the handler's write is in flight.
async fn lose_the_lock_mid_write(on_loss: OnLoss, account: u32) -> LostMidWrite {
    let (store, database) = (MemoryStore::new(), Database::default());
    let (app, mut in_flight) = deposit_route(short_lease_locks(&store), database.clone(), on_loss);
    let addr = serve(app).await;

    let path = format!("/accounts/{account}/deposits");
    let request = tokio::spawn(async move { http_post(addr, &path).await });
    let commit = guarded(in_flight.recv())
        .await
        .expect("the write is in flight");
    assert!(store.break_lease(&format!("accounts/{account}")));
    LostMidWrite {
        database,
        request,
        commit,
    }
}

#[tokio::test]
async fn a_lock_lost_while_the_write_is_in_flight_is_answered_outcome_unknown() {
    let lost = lose_the_lock_mid_write(OnLoss::Cancel, 7).await;
    let reply = guarded(lost.request).await.expect("reply");
    // The database applies the write after all: the answer must not have claimed it stopped.
    lost.commit.send(()).expect("the database is still there");
    lost.database.until_applied(1).await;
    assert_eq!(lost.database.applied(), 1, "the write was applied once");
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.code(), "locking.lost");
    assert!(
        reply.retry_after().is_none(),
        "no invitation to retry blindly"
    );
    let detail = reply.problem()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(detail.contains("outcome is unknown"), "{detail}");
    assert!(!detail.contains("stopped"), "{detail}");
}

#[tokio::test]
async fn with_on_loss_signal_the_handler_finishes_its_write_and_answers_itself() {
    let lost = lose_the_lock_mid_write(OnLoss::Signal, 8).await;
    // The loss is noticed by the next renewal (every 100 ms), while the write is in flight.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!lost.request.is_finished(), "the handler was not dropped");
    lost.commit
        .send(())
        .expect("the handler still waits for its write");
    let reply = guarded(lost.request).await.expect("reply");
    assert_eq!(lost.database.applied(), 1);
    assert_eq!(reply.status, StatusCode::ACCEPTED, "{reply:?}");
    assert!(reply.text().contains("lost meanwhile"), "{reply:?}");
}

/// Counts the errors logged while it is installed (on this thread, which the current-thread
/// test runtime and the server share).
#[derive(Clone, Default)]
struct ErrorCount(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ErrorCount {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl ErrorCount {
    /// A count installed for as long as the guard lives.
    fn installed() -> (Self, tracing::subscriber::DefaultGuard) {
        use tracing_subscriber::layer::SubscriberExt;
        let count = ErrorCount::default();
        let registry = tracing_subscriber::registry().with(count.clone());
        (count, tracing::subscriber::set_default(registry))
    }

    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// `POST /orders/{id}/ship` locked twice on `orders/{id}`: by a route layer of `inner` on the
/// route, and by a route layer of `outer` added after it, which (as `route_layer` wraps every
/// route added before it) wraps the route too.
fn doubly_locked(inner: DistributedLock, outer: DistributedLock) -> Router {
    Router::new()
        .route(
            "/orders/{id}/ship",
            post(|| async { "shipped" }).route_layer(lock_route(inner, "orders/{id}")),
        )
        .route_layer(lock_route(outer, "orders/{id}"))
}

#[tokio::test]
async fn two_layers_locking_one_key_are_a_500_logged_once_and_lock_nothing() {
    let (errors, _log) = ErrorCount::installed();
    let locks = DistributedLock::in_memory();
    let addr = serve(doubly_locked(locks.clone(), locks.clone())).await;
    for _ in 0..3 {
        let reply = guarded(http_post(addr, "/orders/1/ship")).await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
        assert_eq!(reply.code(), "locking.misconfigured");
    }
    assert_eq!(errors.count(), 1, "the mistake is logged once");
    // The outer layer's lock was released with the response; nothing stays held.
    assert_eq!(locks.local_callers(), 0);
    // Another provider's lock on the same key is no mistake: they are different locks.
    let addr = serve(doubly_locked(DistributedLock::in_memory(), locks)).await;
    let reply = guarded(http_post(addr, "/orders/1/ship")).await;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
}

#[tokio::test]
async fn a_template_naming_a_parameter_the_route_lacks_is_a_500_logged_once() {
    let (errors, _log) = ErrorCount::installed();
    let locks = DistributedLock::in_memory();
    let app = Router::new()
        .route("/orders/{id}/ship", post(|| async { "shipped" }))
        .route_layer(lock_route(locks.clone(), "orders/{Id}"));
    let addr = serve(app).await;
    for id in 0..3 {
        let reply = guarded(http_post(addr, &format!("/orders/{id}/ship"))).await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
        assert_eq!(reply.code(), "locking.misconfigured");
        assert!(
            !reply.text().contains("Id"),
            "the document names no internals"
        );
    }
    assert_eq!(errors.count(), 1);
    assert_eq!(locks.local_callers(), 0, "nothing was locked");
}

/// A backend whose startup check fails with `Misconfigured` and counts how often it runs.
#[derive(Clone, Default)]
struct Unverifiable {
    checks: Arc<AtomicUsize>,
}

impl lockingkit::backend::LockBackend for Unverifiable {
    type Lease = ();
    fn provider(&self) -> &str {
        "unverifiable"
    }
    fn timing(&self) -> lockingkit::backend::LeaseTiming {
        lockingkit::backend::LeaseTiming::Expiring(Duration::from_secs(30))
    }
    async fn try_acquire(
        &self,
        _key: &str,
        _mode: LockMode,
    ) -> Result<Option<lockingkit::backend::Acquired<()>>, lockingkit::backend::BackendError> {
        Ok(None)
    }
    async fn renew(&self, _lease: &()) -> Result<(), lockingkit::backend::BackendError> {
        Ok(())
    }
    async fn release(&self, _lease: &()) -> Result<(), lockingkit::backend::BackendError> {
        Ok(())
    }
    async fn verify(&self) -> Result<(), lockingkit::backend::BackendError> {
        self.checks.fetch_add(1, Ordering::SeqCst);
        Err(lockingkit::backend::BackendError::misconfigured(
            "the container does not exist",
        ))
    }
}

#[tokio::test]
async fn the_readiness_endpoint_reports_an_outage_and_a_failed_startup_check_as_503() {
    use lockingkit_axum::Readiness;

    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let app = Router::new().route_service("/ready", Readiness::of([locks.clone()]));
    let addr = serve(app).await;
    let ready = guarded(support::get(addr, "/ready")).await;
    assert_eq!(ready.status, StatusCode::OK, "{ready:?}");
    assert_eq!(ready.text(), r#"{"status":"ready"}"#);

    // An attempt fails: the provider is failing until one is answered again.
    store.set_unavailable(true);
    assert!(locks.try_acquire("k").await.is_err());
    let down = guarded(support::get(addr, "/ready")).await;
    assert_eq!(down.status, StatusCode::SERVICE_UNAVAILABLE, "{down:?}");
    assert_eq!(down.code(), "locking.unavailable");
    assert!(down.retry_after().is_some());
    store.set_unavailable(false);
    tokio::time::sleep(Duration::from_millis(100)).await; // the first probe is due by then
    locks
        .try_acquire("k")
        .await
        .expect("answered again")
        .release()
        .await
        .expect("release");
    assert_eq!(
        guarded(support::get(addr, "/ready")).await.status,
        StatusCode::OK
    );

    // A provider whose startup check fails is not ready, and probes do not hammer it.
    let backend = Unverifiable::default();
    let checks = backend.checks.clone();
    let broken = DistributedLock::builder(backend).build().expect("provider");
    let addr = serve(Router::new().route_service("/ready", Readiness::of([broken]))).await;
    for _ in 0..5 {
        let reply = guarded(support::get(addr, "/ready")).await;
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
        assert_eq!(reply.code(), "locking.misconfigured");
        assert!(
            !reply.text().contains("container"),
            "no internals in the document"
        );
    }
    assert_eq!(checks.load(Ordering::SeqCst), 1, "one check per 5 s");
}
