//! Shared (reader) and semaphore layers behind hyper's own server over real HTTP on 127.0.0.1.

use crate::support;

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use lockingkit::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use lockingkit::{DistributedLock, ErrorKind, LockMode, LockView, MemoryBackend, MemoryStore};
use lockingkit_tower::LockLayer;
use tokio::sync::{mpsc, Barrier, Semaphore};
use tower::service_fn;

use support::{call, guarded, path_key, serve_behind, short_lease_locks};

/// A handler that reports its lock mode on `entered`, then parks until `open` has a permit
/// (which it hands back, so one permit lets every parked handler through).
fn parked(
    entered: mpsc::UnboundedSender<LockMode>,
    open: Arc<Semaphore>,
) -> impl tower::Service<
    Request<Incoming>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    service_fn(move |request: Request<Incoming>| {
        let (entered, open) = (entered.clone(), open.clone());
        async move {
            let lock = request.extensions().get::<LockView>().cloned();
            let mode = lock.as_ref().map(LockView::mode);
            let _ = entered.send(mode.unwrap_or(LockMode::Exclusive));
            let _permit = open.acquire().await;
            open.add_permits(1);
            let token = lock.map_or(0, |lock| lock.fencing_token());
            Ok(Response::new(Full::new(Bytes::from(format!("{token}")))))
        }
    })
}

#[tokio::test]
async fn readers_of_one_key_are_in_flight_together_and_a_writer_is_refused_meanwhile() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    // Both readers must be inside their handler at once to pass the barrier; with an
    // exclusive layer the second would be refused and the first would hang (the guard fails).
    let barrier = Arc::new(Barrier::new(2));
    let (inside_tx, mut inside) = mpsc::unbounded_channel();
    let open = Arc::new(Semaphore::new(0));
    let reader = {
        let open = open.clone();
        service_fn(move |request: Request<Incoming>| {
            let (barrier, inside_tx, open) = (barrier.clone(), inside_tx.clone(), open.clone());
            async move {
                barrier.wait().await;
                let lock = request.extensions().get::<LockView>().cloned();
                let _ = inside_tx.send(lock.map(|lock| lock.mode()));
                let _permit = open.acquire().await;
                open.add_permits(1);
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("read"))))
            }
        })
    };
    let shared = LockLayer::new(locks.clone(), path_key).shared();
    let reads = serve_behind(shared.expect("in-memory reads"), reader).await;
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let writes = serve_behind(
        LockLayer::new(locks.clone(), path_key),
        parked(entered_tx, open.clone()),
    )
    .await;

    let first = tokio::spawn(call(reads, Method::GET, "/orders/5"));
    let second = tokio::spawn(call(reads, Method::GET, "/orders/5"));
    for _ in 0..2 {
        let mode = guarded(inside.recv()).await.expect("a reader is inside");
        assert_eq!(mode, Some(LockMode::Shared));
    }
    assert_eq!(store.readers_of("orders/5"), 2);

    let refused = guarded(call(writes, Method::POST, "/orders/5")).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{refused:?}");
    assert_eq!(refused.code(), "locking.busy");
    assert_eq!(refused.retry_after.as_deref(), Some("1"));
    assert!(entered.try_recv().is_err(), "the writer ran beside readers");

    open.add_permits(1);
    for reply in [first, second] {
        let reply = guarded(reply).await.expect("reader reply");
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    }
    // Readers released before answering: the writer gets in at once.
    let write = guarded(call(writes, Method::POST, "/orders/5")).await;
    assert_eq!(write.status, StatusCode::OK, "{write:?}");
    assert_eq!(entered.try_recv(), Ok(LockMode::Exclusive));
}

#[tokio::test]
async fn a_semaphore_layer_of_two_admits_two_and_answers_the_third_429() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let open = Arc::new(Semaphore::new(0));
    let slots = LockLayer::new(locks, path_key).semaphore(2);
    let slots = slots.expect("in-memory semaphores");
    let addr = serve_behind(slots, parked(entered_tx, open.clone())).await;

    let first = tokio::spawn(call(addr, Method::POST, "/exports/acme"));
    let second = tokio::spawn(call(addr, Method::POST, "/exports/acme"));
    for _ in 0..2 {
        let mode = guarded(entered.recv()).await.expect("a request is inside");
        assert_eq!(mode, LockMode::Semaphore { max_count: 2 });
    }
    assert_eq!(store.semaphore_holders("exports/acme"), 2);

    let third = guarded(call(addr, Method::POST, "/exports/acme")).await;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS, "{third:?}");
    assert_eq!(third.code(), "locking.busy");
    assert_eq!(third.retry_after.as_deref(), Some("1"));
    assert!(
        !String::from_utf8_lossy(&third.body).contains("acme"),
        "the key leaked: {third:?}"
    );
    // Another key has slots of its own.
    let other = tokio::spawn(call(addr, Method::POST, "/exports/globex"));
    guarded(entered.recv())
        .await
        .expect("another key's request is inside");

    open.add_permits(1);
    for reply in [first, second, other] {
        let reply = guarded(reply).await.expect("reply");
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    }
    // Each slot was freed before its response was sent: two fit again.
    assert_eq!(store.semaphore_holders("exports/acme"), 0);
    let (a, b) = guarded(async {
        tokio::join!(
            call(addr, Method::POST, "/exports/acme"),
            call(addr, Method::POST, "/exports/acme")
        )
    })
    .await;
    assert_eq!((a.status, b.status), (StatusCode::OK, StatusCode::OK));
}

#[tokio::test]
async fn losing_a_semaphore_slot_mid_request_drops_the_handler_and_answers_outcome_unknown() {
    let store = MemoryStore::new();
    // A short lease makes renewals notice the broken slot quickly.
    let locks = short_lease_locks(&store);
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let (dropped_tx, mut dropped) = mpsc::unbounded_channel::<()>();
    let handler = service_fn(move |_request: Request<Incoming>| {
        let (entered_tx, dropped_tx) = (entered_tx.clone(), dropped_tx.clone());
        async move {
            let _signal = DropSignal(dropped_tx);
            let _ = entered_tx.send(());
            std::future::pending::<()>().await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        }
    });
    let slot = LockLayer::new(locks, path_key).semaphore(1).expect("slots");
    let addr = serve_behind(slot, handler).await;

    let request = tokio::spawn(call(addr, Method::POST, "/exports/acme"));
    guarded(entered.recv()).await.expect("inside");
    assert!(store.break_semaphore_slot("exports/acme", 0));

    let reply = guarded(request).await.expect("reply");
    // The outcome is unknown, and nothing invites a blind retry.
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.code(), "locking.lost");
    assert!(reply.retry_after.is_none());
    guarded(dropped.recv())
        .await
        .expect("the handler was dropped");
}

struct DropSignal(mpsc::UnboundedSender<()>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// A backend that can hold only exclusive locks (the `LockBackend` default), like Azure.
struct ExclusiveOnly(MemoryBackend);

impl LockBackend for ExclusiveOnly {
    type Lease = <MemoryBackend as LockBackend>::Lease;

    fn provider(&self) -> &str {
        "exclusive_only"
    }

    fn timing(&self) -> LeaseTiming {
        self.0.timing()
    }

    fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> impl Future<Output = Result<Option<Acquired<Self::Lease>>, BackendError>> + Send {
        self.0.try_acquire(key, mode)
    }

    fn renew(&self, lease: &Self::Lease) -> impl Future<Output = Result<(), BackendError>> + Send {
        self.0.renew(lease)
    }

    fn release(
        &self,
        lease: &Self::Lease,
    ) -> impl Future<Output = Result<(), BackendError>> + Send {
        self.0.release(lease)
    }
}

#[tokio::test]
async fn a_provider_without_shared_locks_or_semaphores_refuses_the_layer_when_it_is_built() {
    let locks = DistributedLock::builder(ExclusiveOnly(MemoryBackend::new(MemoryStore::new())))
        .build()
        .expect("lock provider");
    let layer = LockLayer::new(locks.clone(), path_key);

    let shared = layer.clone().shared().expect_err("no shared locks here");
    assert_eq!(shared.kind(), ErrorKind::Misconfigured);
    assert!(shared.to_string().contains("shared"), "{shared}");
    let slots = layer.clone().semaphore(2).expect_err("no semaphores here");
    assert_eq!(slots.kind(), ErrorKind::Misconfigured);
    assert!(slots.to_string().contains("semaphore"), "{slots}");
    // The exclusive layer it started from still works.
    assert_eq!(layer.mode(), LockMode::Exclusive);
    let ok = service_fn(|_request: Request<Incoming>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok"))))
    });
    let addr = serve_behind(layer, ok).await;
    let reply = guarded(call(addr, Method::POST, "/orders/1")).await;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");

    // Out-of-range counts are refused even where semaphores exist.
    let memory = LockLayer::new(DistributedLock::in_memory(), path_key);
    for count in [0, lockingkit::backend::MAX_SEMAPHORE_COUNT + 1] {
        let error = memory.clone().semaphore(count).expect_err("out of range");
        assert_eq!(error.kind(), ErrorKind::Misconfigured);
    }
}
