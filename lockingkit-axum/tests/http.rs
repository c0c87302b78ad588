//! The axum integration over real HTTP on 127.0.0.1, with a real HTTP/1.1 client.

use crate::support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, Path, Request};
use axum::middleware::{self, Next};
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use http::StatusCode;
use lockingkit::{DistributedLock, MemoryStore};
use lockingkit_axum::{lock_route, lock_route_from_state, lock_route_waiting, HeldLock};
use tokio::sync::{mpsc, Barrier, Semaphore};

use support::{
    get as http_get, guarded, post as http_post, serve, serve_ship_route, short_lease_locks,
    show_lock, Reply,
};

/// Sends a drop notice when the handler's future is dropped.
struct DropSignal(mpsc::UnboundedSender<&'static str>);

impl Drop for DropSignal {
    fn drop(&mut self) {
        let _ = self.0.send("dropped");
    }
}

fn token_in(reply: &Reply) -> u64 {
    reply
        .text()
        .rsplit(' ')
        .next()
        .and_then(|token| token.parse().ok())
        .unwrap_or_else(|| panic!("no token in {reply:?}"))
}

/// `POST` answered by a handler that reports its fencing token on `entered`, then waits until
/// `open` has a permit (which it hands back, so one permit lets every waiting handler through)
/// and answers "shipped {token}".
fn parked_ship(entered: mpsc::UnboundedSender<u64>, open: Arc<Semaphore>) -> MethodRouter {
    post(move |lock: HeldLock| async move {
        let _ = entered.send(lock.fencing_token());
        let _permit = open.acquire().await;
        open.add_permits(1);
        format!("shipped {}", lock.fencing_token())
    })
}

#[tokio::test]
async fn concurrent_requests_for_one_key_get_one_200_and_409_busy_for_the_rest() {
    let locks = DistributedLock::in_memory();
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let open = Arc::new(Semaphore::new(0));
    let app = Router::new()
        .route("/orders/{id}/ship", parked_ship(entered_tx, open.clone()))
        .route_layer(lock_route(locks.clone(), "orders/{id}"));
    let addr = serve(app).await;

    const CLIENTS: usize = 5;
    let (replies_tx, mut replies) = mpsc::unbounded_channel();
    for _ in 0..CLIENTS {
        let replies_tx = replies_tx.clone();
        tokio::spawn(async move {
            let _ = replies_tx.send(http_post(addr, "/orders/7/ship").await);
        });
    }

    // While the one holder is parked in its handler, every other request is refused.
    let holder_token = guarded(entered.recv()).await.expect("a handler ran");
    for _ in 1..CLIENTS {
        let reply = guarded(replies.recv()).await.expect("a reply");
        reply.assert_busy_without("orders/7");
    }
    open.add_permits(1);
    let reply = guarded(replies.recv()).await.expect("the holder's reply");
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(token_in(&reply), holder_token);
    assert!(
        entered.try_recv().is_err(),
        "exactly one handler may run for the key"
    );
}

#[tokio::test]
async fn requests_for_different_keys_run_in_parallel() {
    let locks = DistributedLock::in_memory();
    // Both handlers must be inside at the same time to pass the barrier.
    let barrier = Arc::new(Barrier::new(2));
    let handler = move |lock: HeldLock| {
        let barrier = barrier.clone();
        async move {
            barrier.wait().await;
            show_lock(lock).await
        }
    };
    let app = Router::new()
        .route("/orders/{id}/ship", post(handler))
        .route_layer(lock_route(locks, "orders/{id}"));
    let addr = serve(app).await;

    let (one, two) = guarded(async {
        tokio::join!(
            http_post(addr, "/orders/1/ship"),
            http_post(addr, "/orders/2/ship")
        )
    })
    .await;
    assert_eq!(one.status, StatusCode::OK, "{one:?}");
    assert_eq!(two.status, StatusCode::OK, "{two:?}");
    assert!(one.text().starts_with("orders/1 "));
    assert!(two.text().starts_with("orders/2 "));
}

#[tokio::test]
async fn wait_mode_serves_the_second_request_after_the_first() {
    let locks = DistributedLock::in_memory();
    let (entered_tx, mut entered) = mpsc::unbounded_channel();
    let (arrived_tx, mut arrived) = mpsc::unbounded_channel::<()>();
    let open = Arc::new(Semaphore::new(0));
    let app = Router::new()
        .route("/orders/{id}/ship", parked_ship(entered_tx, open.clone()))
        .route_layer(lock_route_waiting(
            locks,
            "orders/{id}",
            Duration::from_secs(10),
        ))
        // Outside the lock layer: tells the test a request has reached it. On this
        // current-thread runtime the request then polls its acquisition before the test runs.
        .layer(middleware::from_fn(move |request: Request, next: Next| {
            let _ = arrived_tx.send(());
            next.run(request)
        }));
    let addr = serve(app).await;

    let first = tokio::spawn(http_post(addr, "/orders/3/ship"));
    guarded(arrived.recv()).await;
    let first_token = guarded(entered.recv()).await.expect("first handler");
    let second = tokio::spawn(http_post(addr, "/orders/3/ship"));
    guarded(arrived.recv()).await;
    assert!(
        entered.try_recv().is_err(),
        "the second request must wait while the first holds the lock"
    );

    open.add_permits(1);
    let first = guarded(first).await.expect("first request");
    let second = guarded(second).await.expect("second request");
    assert_eq!(first.status, StatusCode::OK, "{first:?}");
    assert_eq!(second.status, StatusCode::OK, "{second:?}");
    let second_token = guarded(entered.recv()).await.expect("second handler");
    assert!(second_token > first_token);
    assert_eq!(token_in(&second), second_token);
}

#[tokio::test]
async fn wait_mode_times_out_with_409_timeout() {
    let locks = DistributedLock::in_memory();
    let addr = serve_ship_route(lock_route_waiting(
        locks.clone(),
        "orders/{id}",
        Duration::from_millis(100),
    ))
    .await;
    let held = locks.try_acquire("orders/4").await.expect("free");

    let reply = guarded(http_post(addr, "/orders/4/ship")).await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{reply:?}");
    assert_eq!(reply.code(), "locking.timeout");
    assert_eq!(reply.retry_after().as_deref(), Some("1"));
    held.release().await.expect("release");
}

#[tokio::test]
async fn losing_the_lock_mid_handler_stops_the_handler_and_says_the_outcome_is_unknown() {
    let store = MemoryStore::new();
    let locks = short_lease_locks(&store);
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let finished = Arc::new(AtomicBool::new(false));
    let slow = {
        let finished = finished.clone();
        move |_lock: HeldLock| async move {
            let _signal = DropSignal(events_tx.clone());
            let _ = events_tx.send("entered");
            std::future::pending::<()>().await;
            finished.store(true, Ordering::SeqCst);
            "finished"
        }
    };
    let app = Router::new()
        .route("/orders/{id}/slow-ship", post(slow))
        .route("/orders/{id}/ship", post(show_lock))
        .route_layer(lock_route(locks.clone(), "orders/{id}"));
    let addr = serve(app).await;

    let request = tokio::spawn(http_post(addr, "/orders/9/slow-ship"));
    assert_eq!(guarded(events.recv()).await, Some("entered"));
    assert!(store.break_lease("orders/9"), "the handler holds a lease");

    let reply = guarded(request).await.expect("reply");
    // Not 503, which clients and proxies retry: the handler may have applied its effects.
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.code(), "locking.lost");
    assert!(reply.retry_after().is_none());
    assert!(reply.text().contains("outcome is unknown"), "{reply:?}");
    assert_eq!(guarded(events.recv()).await, Some("dropped"));
    assert!(!finished.load(Ordering::SeqCst));

    let next = guarded(http_post(addr, "/orders/9/ship")).await;
    assert_eq!(next.status, StatusCode::OK, "{next:?}");
}

#[tokio::test]
async fn invalid_keys_are_400_and_a_template_naming_an_uncaptured_parameter_is_500() {
    let locks = DistributedLock::in_memory();
    let app = Router::new()
        .route(
            "/orders/{id}/ship",
            post(show_lock).route_layer(lock_route(locks.clone(), "orders/{id}")),
        )
        .route(
            "/carts/{cart}/pay",
            post(show_lock).route_layer(lock_route(locks, "carts/{cart_id}")),
        );
    let addr = serve(app).await;

    let too_long = "x".repeat(600);
    let reply = guarded(http_post(addr, &format!("/orders/{too_long}/ship"))).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{reply:?}");
    assert_eq!(reply.code(), "locking.invalid_key");
    assert!(reply.retry_after().is_none());
    assert!(!reply.text().contains(&too_long));

    // The template names a parameter the route does not have: a bug in the server, not in the
    // request.
    let reply = guarded(http_post(addr, "/carts/5/pay")).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.code(), "locking.misconfigured");
}

#[tokio::test]
async fn an_unavailable_backend_is_503_with_retry_after() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let addr = serve_ship_route(lock_route(locks, "orders/{id}")).await;

    store.set_unavailable(true);
    let reply = guarded(http_post(addr, "/orders/1/ship")).await;
    assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
    assert_eq!(reply.code(), "locking.unavailable");
    assert_eq!(reply.retry_after().as_deref(), Some("5"));

    // Callers are refused at once until the backend's first probe is due (min_retry_delay,
    // 50 ms, after the failure); the first request after that finds it back.
    store.set_unavailable(false);
    let back = std::time::Instant::now();
    loop {
        let reply = guarded(http_post(addr, "/orders/1/ship")).await;
        if reply.status == StatusCode::OK {
            break;
        }
        assert_eq!(reply.status, StatusCode::SERVICE_UNAVAILABLE, "{reply:?}");
        assert!(
            back.elapsed() < std::time::Duration::from_secs(2),
            "not back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn the_handler_sees_the_key_and_a_growing_fencing_token() {
    let locks = DistributedLock::in_memory();
    let addr = serve_ship_route(lock_route(locks.clone(), "orders/{id}")).await;

    let first = guarded(http_post(addr, "/orders/42/ship")).await;
    // Percent-encoded path parameters lock the same key as their decoded form.
    let second = guarded(http_post(addr, "/orders/%34%32/ship")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert!(first.text().starts_with("orders/42 "), "{first:?}");
    assert!(second.text().starts_with("orders/42 "), "{second:?}");
    assert!(token_in(&second) > token_in(&first));

    let direct = locks.try_acquire("orders/42").await.expect("free");
    assert!(direct.fencing_token() > token_in(&second));
}

#[tokio::test]
async fn the_lock_is_free_as_soon_as_the_response_is_sent() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let addr = serve_ship_route(lock_route(locks.clone(), "orders/{id}")).await;

    for _ in 0..10 {
        let reply = guarded(http_post(addr, "/orders/8/ship")).await;
        assert_eq!(reply.status, StatusCode::OK);
        // The layer waited for the release to be confirmed before sending the response.
        assert!(!store.is_locked("orders/8"));
        let handle = locks.try_acquire("orders/8").await.expect("free at once");
        handle.release().await.expect("release");
    }
}

#[tokio::test]
async fn held_lock_on_a_route_without_a_lock_layer_is_a_500_problem() {
    let app = Router::new().route("/unlocked", post(show_lock)).route(
        "/maybe",
        get(|lock: Option<HeldLock>| async move {
            if lock.is_some() {
                "locked"
            } else {
                "unlocked"
            }
        }),
    );
    let addr = serve(app).await;

    let reply = guarded(http_post(addr, "/unlocked")).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.code(), "locking.misconfigured");
    let reply = guarded(http_get(addr, "/maybe")).await;
    assert_eq!(reply.text(), "unlocked");
}

#[derive(Clone)]
struct AppState {
    locks: DistributedLock,
}

impl FromRef<AppState> for DistributedLock {
    fn from_ref(state: &AppState) -> Self {
        state.locks.clone()
    }
}

#[tokio::test]
async fn the_route_helper_takes_the_lock_provider_from_app_state() {
    let state = AppState {
        locks: DistributedLock::in_memory(),
    };
    let app = Router::new()
        .route(
            "/orders/{id}/ship",
            post(|Path(id): Path<u32>, lock: HeldLock| async move {
                format!("{id} {}", lock.fencing_token())
            }),
        )
        .route_layer(lock_route_from_state(&state, "orders/{id}"))
        .with_state(state.clone());
    let addr = serve(app).await;

    let held = state.locks.try_acquire("orders/6").await.expect("held");
    let reply = guarded(http_post(addr, "/orders/6/ship")).await;
    assert_eq!(reply.status, StatusCode::CONFLICT);
    assert_eq!(reply.code(), "locking.busy");
    held.release().await.expect("release");
    let reply = guarded(http_post(addr, "/orders/6/ship")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert!(reply.text().starts_with("6 "));
}
