//! `LockService` as a plain tower service: ordering of release and response, readiness,
//! cancellation and the request's lock view.

use crate::support;

use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use http_body_util::Full;
use lockingkit::backend::{BackendError, LeaseTiming, LockBackend};
use lockingkit::{DistributedLock, ErrorKind, LockMode, LockView, MemoryBackend, MemoryStore};
use lockingkit_tower::{LockKey, LockLayer};
use tokio::sync::{mpsc, Semaphore};
use tower::{service_fn, Layer, Service, ServiceBuilder, ServiceExt};

use support::{guarded, path_key, ChannelBody, HANG_GUARD};

fn request(path: &str) -> Request<()> {
    Request::builder().uri(path).body(()).expect("request")
}

fn empty() -> Response<Full<Bytes>> {
    Response::new(Full::new(Bytes::new()))
}

/// The in-memory backend, with releases that report when they start and then wait for the
/// test to let them through.
struct GatedRelease {
    inner: MemoryBackend,
    started: mpsc::UnboundedSender<()>,
    gate: Arc<Semaphore>,
}

impl LockBackend for GatedRelease {
    type Lease = <MemoryBackend as LockBackend>::Lease;

    fn provider(&self) -> &str {
        "gated_in_memory"
    }

    fn timing(&self) -> LeaseTiming {
        self.inner.timing()
    }

    fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> impl Future<Output = Result<Option<lockingkit::backend::Acquired<Self::Lease>>, BackendError>>
           + Send {
        self.inner.try_acquire(key, mode)
    }

    fn renew(&self, lease: &Self::Lease) -> impl Future<Output = Result<(), BackendError>> + Send {
        self.inner.renew(lease)
    }

    async fn release(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        let _ = self.started.send(());
        let _permit = self.gate.acquire().await;
        self.inner.release(lease).await
    }
}

#[tokio::test]
async fn the_response_is_held_back_until_the_release_is_confirmed() {
    let store = MemoryStore::new();
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let locks = DistributedLock::builder(GatedRelease {
        inner: MemoryBackend::new(store.clone()),
        started: started_tx,
        gate: gate.clone(),
    })
    .build()
    .expect("lock provider");
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(locks, path_key))
        .service(service_fn(|_: Request<()>| async {
            Ok::<_, Infallible>(empty())
        }));

    let call = tokio::spawn(service.oneshot(request("/orders/1")));
    guarded(started.recv()).await;
    // The handler is done and the release is at the backend: the response must wait for it.
    assert!(!call.is_finished());
    assert!(store.is_locked("orders/1"));

    gate.add_permits(1);
    let response = guarded(call).await.expect("task").expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    assert!(!store.is_locked("orders/1"));
}

/// A lock whose releases wait for the test's `gate`, each reported on the receiver when it
/// starts.
fn gated(
    store: &MemoryStore,
    lease: Duration,
) -> (DistributedLock, mpsc::UnboundedReceiver<()>, Arc<Semaphore>) {
    let (started_tx, started) = mpsc::unbounded_channel();
    let gate = Arc::new(Semaphore::new(0));
    let locks = DistributedLock::builder(GatedRelease {
        inner: MemoryBackend::with_lease(store.clone(), lease),
        started: started_tx,
        gate: gate.clone(),
    })
    .build()
    .expect("lock provider");
    (locks, started, gate)
}

/// "/transfers/1/2" locks "accounts/1" and "accounts/2".
fn accounts(parts: &Parts) -> Option<Vec<String>> {
    let mut ids = parts.uri.path().strip_prefix("/transfers/")?.split('/');
    let (from, to) = (ids.next()?, ids.next()?);
    Some(vec![format!("accounts/{from}"), format!("accounts/{to}")])
}

/// Breaks `accounts/2`'s lease and waits until both releases are at the gated backend: the
/// lost member's best-effort one and the other member's, given up by the hold.
async fn lose_accounts_2(store: &MemoryStore, started: &mut mpsc::UnboundedReceiver<()>) {
    assert!(store.break_lease("accounts/2"));
    guarded(started.recv()).await;
    guarded(started.recv()).await;
    // On paused time this returns once every task is idle: whatever the layer would do
    // without the backend's answer, it has done.
    tokio::time::sleep(Duration::from_millis(1)).await;
}

#[tokio::test(start_paused = true)]
async fn a_lost_member_is_answered_only_after_the_other_member_is_released() {
    let store = MemoryStore::new();
    let (locks, mut started, gate) = gated(&store, Duration::from_millis(300));
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let service = ServiceBuilder::new()
        .layer(LockLayer::all(locks, accounts))
        .service(service_fn(move |_: Request<()>| {
            let _ = entered_tx.send(());
            std::future::pending::<Result<Response<Full<Bytes>>, Infallible>>()
        }));
    let call = tokio::spawn(service.oneshot(request("/transfers/1/2")));
    guarded(entered.recv()).await;

    lose_accounts_2(&store, &mut started).await;
    assert!(!call.is_finished(), "answered while accounts/1 is held");
    assert!(store.is_locked("accounts/1"));

    gate.add_permits(2);
    let response = guarded(call).await.expect("task").expect("response");
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        !store.is_locked("accounts/1"),
        "answered before the release"
    );
}

#[tokio::test(start_paused = true)]
async fn a_member_lost_mid_stream_breaks_the_body_only_after_the_other_is_released() {
    let store = MemoryStore::new();
    let (locks, mut started, gate) = gated(&store, Duration::from_millis(300));
    let (senders_tx, mut senders) = mpsc::unbounded_channel();
    let service = ServiceBuilder::new()
        .layer(LockLayer::all(locks, accounts).hold_until_body_ends())
        .service(service_fn(move |_: Request<()>| {
            let (tx, rx) = mpsc::unbounded_channel();
            let _ = senders_tx.send(tx);
            async move { Ok::<_, Infallible>(Response::new(ChannelBody(rx))) }
        }));
    let response = guarded(service.oneshot(request("/transfers/1/2")))
        .await
        .expect("response");
    let body_tx = guarded(senders.recv()).await.expect("handler ran");
    let mut body = response.into_body();
    body_tx.send(Bytes::from_static(b"part 1")).expect("send");
    guarded(body.frame()).await.expect("frame").expect("data");

    lose_accounts_2(&store, &mut started).await;
    let rest = tokio::spawn(async move { body.collect().await.map(|_| ()) });
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(!rest.is_finished(), "broken while accounts/1 is held");
    assert!(store.is_locked("accounts/1"));

    gate.add_permits(2);
    let rest = guarded(rest).await.expect("task");
    assert!(rest.is_err(), "the body must fail");
    assert!(!store.is_locked("accounts/1"), "broken before the release");
    drop(body_tx);
}

#[derive(Clone)]
struct Readiness(Arc<AtomicBool>);

impl Service<Request<()>> for Readiness {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if self.0.load(Ordering::SeqCst) {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn call(&mut self, _request: Request<()>) -> Self::Future {
        std::future::ready(Ok(empty()))
    }
}

#[tokio::test]
async fn poll_ready_reports_the_inner_services_readiness() {
    let ready = Arc::new(AtomicBool::new(false));
    let mut service =
        LockLayer::new(DistributedLock::in_memory(), path_key).layer(Readiness(ready.clone()));
    // Polled once with the test task's own waker: readiness is reported, not awaited.
    let pending = poll_fn(|cx| Poll::Ready(service.poll_ready(cx).is_pending())).await;
    assert!(pending);
    ready.store(true, Ordering::SeqCst);
    let ready = poll_fn(|cx| Poll::Ready(service.poll_ready(cx))).await;
    assert!(matches!(ready, Poll::Ready(Ok(()))));
    let response = guarded(service.call(request("/orders/1")))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn dropping_the_response_future_releases_the_lock() {
    let locks = DistributedLock::in_memory();
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(locks.clone(), path_key))
        .service(service_fn(move |_: Request<()>| {
            let _ = entered_tx.send(());
            async { std::future::pending::<Result<Response<Full<Bytes>>, Infallible>>().await }
        }));

    let call = tokio::spawn(service.oneshot(request("/orders/2")));
    guarded(entered.recv()).await;
    call.abort();
    assert!(guarded(call).await.is_err(), "the call was cancelled");
    // The dropped handle releases in the background and wakes this local waiter.
    let handle = guarded(locks.acquire("orders/2", HANG_GUARD))
        .await
        .expect("released after the client went away");
    handle.release().await.expect("release");
}

#[tokio::test]
async fn work_tied_to_the_request_lock_stops_when_the_layer_releases_it() {
    let (outcome_tx, mut outcome) = mpsc::unbounded_channel();
    let (view_tx, mut view) = mpsc::unbounded_channel();
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(DistributedLock::in_memory(), path_key))
        .service(service_fn(move |request: Request<()>| {
            let lock = request.extensions().get::<LockView>().cloned();
            let outcome_tx = outcome_tx.clone();
            let _ = view_tx.send(lock.clone());
            async move {
                if let Some(lock) = lock {
                    lock.ensure_held().expect("held inside the handler");
                    tokio::spawn(async move {
                        let result = lock.run(std::future::pending::<()>()).await;
                        let _ = outcome_tx.send(result.map_err(|error| error.kind()));
                    });
                }
                Ok::<_, Infallible>(empty())
            }
        }));

    let response = guarded(service.oneshot(request("/orders/secret-customer-7")))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        guarded(outcome.recv()).await,
        Some(Err(ErrorKind::Lost)),
        "spawned work stops once the request's lock is released"
    );
    let lock = view
        .recv()
        .await
        .flatten()
        .expect("the handler saw the lock");
    assert!(!lock.is_held());
    assert_eq!(lock.key(), "orders/secret-customer-7");
    assert!(
        !format!("{lock:?}").contains("secret"),
        "Debug must not show the key"
    );
}

/// Locks `orders/…` paths and leaves every other request to the inner service.
struct OrdersOnly;

impl LockKey for OrdersOnly {
    async fn lock_key(&self, request: &mut Parts) -> Option<String> {
        path_key(request).filter(|key| key != "orders/")
    }

    async fn applies_to(&self, request: &mut Parts) -> bool {
        request.uri.path().starts_with("/orders/")
    }
}

/// Derives the path key only after yielding to the runtime once, as an extractor that waits
/// for something would.
struct KeyAfterAYield;

impl LockKey for KeyAfterAYield {
    async fn lock_key(&self, request: &mut Parts) -> Option<String> {
        tokio::task::yield_now().await;
        path_key(request)
    }
}

#[tokio::test]
async fn a_lock_key_that_is_not_ready_at_once_is_awaited_not_taken_for_missing() {
    let locks = DistributedLock::in_memory();
    let service = ServiceBuilder::new()
        .layer(LockLayer::with_key(locks.clone(), KeyAfterAYield))
        .service(service_fn(|request: Request<()>| async move {
            let key = request
                .extensions()
                .get::<LockView>()
                .map(|lock| lock.key().to_owned());
            let mut response = empty();
            if key.as_deref() != Some("orders/5") {
                *response.status_mut() = StatusCode::IM_A_TEAPOT;
            }
            Ok::<_, Infallible>(response)
        }));

    let response = guarded(service.clone().oneshot(request("/orders/5")))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::OK);

    let held = locks.try_acquire("orders/5").await.expect("released");
    let response = guarded(service.oneshot(request("/orders/5")))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::CONFLICT);
    held.release().await.expect("release");
}

#[tokio::test]
async fn requests_a_lock_key_does_not_apply_to_reach_the_inner_service_unlocked() {
    let locks = DistributedLock::in_memory();
    let service = ServiceBuilder::new()
        .layer(LockLayer::with_key(locks.clone(), OrdersOnly))
        .service(service_fn(|request: Request<()>| async move {
            let mut response = empty();
            if request.extensions().get::<LockView>().is_none() {
                *response.status_mut() = StatusCode::NOT_FOUND;
            }
            Ok::<_, Infallible>(response)
        }));
    let held = locks.try_acquire("orders/3").await.expect("free");

    // Not for this layer: the inner service answers, even though no key is derivable.
    let response = guarded(service.clone().oneshot(request("/nowhere")))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    // For this layer: a missing key is still refused, and a held key is still busy.
    let response = guarded(service.clone().oneshot(request("/orders/")))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let response = guarded(service.clone().oneshot(request("/orders/3")))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::CONFLICT);
    held.release().await.expect("release");
    let response = guarded(service.oneshot(request("/orders/3")))
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::OK);
}
