//! `LockRejection` as an axum response: in a rejection mapper and returned by a handler.

mod support;

use std::time::Duration;

use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use lockingkit::{DistributedLock, ErrorKind};
use lockingkit_axum::{lock_route, HeldLock, LockRejection};

use support::{post as http_post, serve};

/// A bound on how long a test may hang if the code under test deadlocks.
const HANG_GUARD: Duration = Duration::from_secs(20);

async fn guarded<F: std::future::Future>(future: F) -> F::Output {
    tokio::time::timeout(HANG_GUARD, future)
        .await
        .expect("the test hung")
}

async fn show_lock(lock: HeldLock) -> String {
    format!("{} {}", lock.key(), lock.fencing_token())
}

#[tokio::test]
async fn a_mapper_answers_its_own_response_and_the_rejection_itself_for_the_rest() {
    let locks = DistributedLock::in_memory();
    let layer =
        lock_route(locks.clone(), "orders/{id}").map_rejection(|rejection: LockRejection| {
            match rejection.kind() {
                ErrorKind::Busy => {
                    (StatusCode::TOO_MANY_REQUESTS, rejection.code()).into_response()
                }
                _ => rejection.into_response(),
            }
        });
    let app = Router::new()
        .route("/orders/{id}/ship", post(show_lock))
        .route_layer(layer);
    let addr = serve(app).await;
    let held = locks.try_acquire("orders/1").await.expect("free");

    let reply = guarded(http_post(addr, "/orders/1/ship")).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS, "{reply:?}");
    assert_eq!(reply.text(), "locking.busy");

    // The documented problem document, as the layer's default would send it.
    let too_long = "y".repeat(513);
    let reply = guarded(http_post(addr, &format!("/orders/{too_long}/ship"))).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{reply:?}");
    let problem = reply.problem();
    assert_eq!(problem["code"], "locking.invalid_key");
    assert_eq!(problem["type"], "about:blank");
    assert_eq!(problem["title"], "Bad Request");
    held.release().await.expect("release");
}

/// Takes a second lock itself and answers as the layer would when it cannot.
async fn reserve(
    State(locks): State<DistributedLock>,
    lock: HeldLock,
) -> Result<String, LockRejection> {
    let stock = locks.try_acquire("inventory/widgets").await?;
    stock.release().await?;
    Ok(format!("reserved under {}", lock.fencing_token()))
}

#[tokio::test]
async fn a_handler_returning_a_lock_rejection_answers_the_documented_problem() {
    let locks = DistributedLock::in_memory();
    let app = Router::new()
        .route("/orders/{id}/reserve", post(reserve))
        .route_layer(lock_route(locks.clone(), "orders/{id}"))
        .with_state(locks.clone());
    let addr = serve(app).await;

    let reply = guarded(http_post(addr, "/orders/2/reserve")).await;
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");

    let held = locks.try_acquire("inventory/widgets").await.expect("free");
    let reply = guarded(http_post(addr, "/orders/2/reserve")).await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{reply:?}");
    let problem = reply.problem();
    assert_eq!(problem["code"], "locking.busy");
    assert_eq!(problem["title"], "Conflict");
    assert!(
        !reply.text().contains("widgets"),
        "the key leaked: {reply:?}"
    );
    assert_eq!(reply.retry_after().as_deref(), Some("1"));
    held.release().await.expect("release");
}
