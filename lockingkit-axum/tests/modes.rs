//! Reading routes that share their key and concurrency-limited routes, over real HTTP on
//! 127.0.0.1 with a real HTTP/1.1 client.

use crate::support;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use http::StatusCode;
use lockingkit::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use lockingkit::{DistributedLock, ErrorKind, LockMode, MemoryBackend, MemoryStore};
use lockingkit_axum::{lock_route, lock_route_waiting, HeldLock};
use tokio::sync::{mpsc, Barrier, Semaphore};

use support::{get as http_get, guarded, post as http_post, serve};

/// What a handler reports when it starts: its lock's mode and fencing token.
type Entered = mpsc::UnboundedSender<(LockMode, u64)>;

/// A handler that reports on `entered`, then parks until `open` has a permit (which it hands
/// back, so one permit lets every parked handler through).
fn parked(
    entered: Entered,
    open: Arc<Semaphore>,
) -> impl Fn(HeldLock) -> std::pin::Pin<Box<dyn Future<Output = String> + Send>> + Clone {
    move |lock: HeldLock| {
        let (entered, open) = (entered.clone(), open.clone());
        Box::pin(async move {
            let _ = entered.send((lock.mode(), lock.fencing_token()));
            let _permit = open.acquire().await;
            open.add_permits(1);
            format!("{} {}", lock.key(), lock.fencing_token())
        })
    }
}

#[tokio::test]
async fn gets_read_together_a_post_is_refused_meanwhile_and_a_waiting_post_follows_them() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    // Both GETs must be inside their handler at once to pass the barrier: with an exclusive
    // layer the second is refused, the first never passes and the hang guard fails the test.
    let barrier = Arc::new(Barrier::new(2));
    let (reading_tx, mut reading) = mpsc::unbounded_channel();
    let open_reads = Arc::new(Semaphore::new(0));
    let read = {
        let open_reads = open_reads.clone();
        move |lock: HeldLock| async move {
            barrier.wait().await;
            let _ = reading_tx.send(lock.mode());
            let _permit = open_reads.acquire().await;
            open_reads.add_permits(1);
            "read"
        }
    };
    let (writing_tx, mut writing) = mpsc::unbounded_channel();
    let write = parked(writing_tx, Arc::new(Semaphore::new(1)));
    let app = Router::new()
        .route(
            "/orders/{id}",
            get(read).route_layer(
                lock_route(locks.clone(), "orders/{id}")
                    .shared()
                    .expect("in-memory reads"),
            ),
        )
        .route(
            "/orders/{id}",
            post(write.clone()).route_layer(lock_route(locks.clone(), "orders/{id}")),
        )
        .route(
            "/orders/{id}/wait",
            post(write).route_layer(lock_route_waiting(
                locks.clone(),
                "orders/{id}",
                Duration::from_secs(10),
            )),
        );
    let addr = serve(app).await;

    let first = tokio::spawn(http_get(addr, "/orders/5"));
    let second = tokio::spawn(http_get(addr, "/orders/5"));
    for _ in 0..2 {
        let mode = guarded(reading.recv()).await.expect("a GET is inside");
        assert_eq!(mode, LockMode::Shared);
    }
    assert_eq!(store.readers_of("orders/5"), 2);

    let refused = guarded(http_post(addr, "/orders/5")).await;
    assert_eq!(refused.status, StatusCode::CONFLICT, "{refused:?}");
    assert_eq!(refused.code(), "locking.busy");
    assert_eq!(refused.retry_after().as_deref(), Some("1"));

    let waiting = tokio::spawn(http_post(addr, "/orders/5/wait"));
    guarded(async {
        while locks.waiting("orders/5") == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(
        writing.try_recv().is_err(),
        "a POST ran while GETs held the key"
    );

    open_reads.add_permits(1);
    for reply in [first, second] {
        let reply = guarded(reply).await.expect("GET reply");
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    }
    let reply = guarded(waiting).await.expect("POST reply");
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    let (mode, _) = writing.try_recv().expect("the waiting POST ran");
    assert_eq!(mode, LockMode::Exclusive);
    assert_eq!(store.readers_of("orders/5"), 0);
}

#[tokio::test]
async fn a_limit_of_two_admits_two_requests_answers_the_third_429_and_frees_slots_after_responses()
{
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let open = Arc::new(Semaphore::new(0));
    let app = Router::new().route(
        "/exports/{tenant}",
        post(parked(entered_tx, open.clone())).route_layer(
            lock_route(locks, "exports/{tenant}")
                .semaphore(2)
                .expect("in-memory semaphores"),
        ),
    );
    let addr = serve(app).await;

    let first = tokio::spawn(http_post(addr, "/exports/acme"));
    let second = tokio::spawn(http_post(addr, "/exports/acme"));
    let mut tokens = Vec::new();
    for _ in 0..2 {
        let (mode, token) = guarded(entered.recv()).await.expect("a request is inside");
        assert_eq!(mode, LockMode::Semaphore { max_count: 2 });
        tokens.push(token);
    }
    assert_ne!(tokens[0], tokens[1], "each slot has a token of its own");
    assert_eq!(store.semaphore_holders("exports/acme"), 2);

    let third = guarded(http_post(addr, "/exports/acme")).await;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS, "{third:?}");
    assert_eq!(third.code(), "locking.busy");
    assert_eq!(third.problem()["title"], "Too Many Requests");
    assert_eq!(third.retry_after().as_deref(), Some("1"));
    assert!(!third.text().contains("acme"), "the key leaked: {third:?}");

    open.add_permits(1);
    for reply in [first, second] {
        let reply = guarded(reply).await.expect("reply");
        assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
        assert!(reply.text().starts_with("exports/acme "), "{reply:?}");
    }
    assert_eq!(store.semaphore_holders("exports/acme"), 0);
    let (a, b) = guarded(async {
        tokio::join!(
            http_post(addr, "/exports/acme"),
            http_post(addr, "/exports/acme")
        )
    })
    .await;
    assert_eq!((a.status, b.status), (StatusCode::OK, StatusCode::OK));
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

#[test]
fn a_provider_without_shared_locks_or_semaphores_refuses_the_route_layer() {
    let locks = DistributedLock::builder(ExclusiveOnly(MemoryBackend::new(MemoryStore::new())))
        .build()
        .expect("lock provider");

    let reads = lock_route(locks.clone(), "orders/{id}").shared();
    let error = reads.expect_err("no shared locks on this provider");
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    assert_eq!(error.code(), "locking.misconfigured");
    let limit = lock_route(locks, "exports/{tenant}").semaphore(3);
    let error = limit.expect_err("no semaphores on this provider");
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
}
