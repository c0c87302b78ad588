//! `LockRejection` as an axum response: in a rejection mapper and returned by a handler.

use crate::support;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use http::StatusCode;
use lockingkit::{DistributedLock, ErrorKind};
use lockingkit_axum::{lock_route, HeldLock, LockRejection};

use support::{guarded, post as http_post, serve, serve_ship_route, Reply};

/// Serves the ship route behind a layer whose mapper answers a busy lock itself (`423` and
/// "custom {code}") and hands every other rejection to `fallback`; checks the mapper's own
/// answer, and returns the reply to a key too long, which `fallback` made.
async fn mapper_with_fallback(fallback: fn(LockRejection) -> Response) -> Reply {
    let locks = DistributedLock::in_memory();
    let layer =
        lock_route(locks.clone(), "orders/{id}").map_rejection(move |rejection: LockRejection| {
            match rejection.kind() {
                ErrorKind::Busy => {
                    (StatusCode::LOCKED, format!("custom {}", rejection.code())).into_response()
                }
                _ => fallback(rejection),
            }
        });
    let addr = serve_ship_route(layer).await;
    let held = locks.try_acquire("orders/1").await.expect("free");

    let reply = guarded(http_post(addr, "/orders/1/ship")).await;
    assert_eq!(reply.status, StatusCode::LOCKED, "{reply:?}");
    assert_eq!(reply.text(), "custom locking.busy");

    let too_long = "y".repeat(513);
    let reply = guarded(http_post(addr, &format!("/orders/{too_long}/ship"))).await;
    held.release().await.expect("release");
    reply
}

#[tokio::test]
async fn a_custom_rejection_mapper_replaces_the_problem_documents() {
    // Cases the mapper passes on to `problem_response` keep the default problem document.
    let reply = mapper_with_fallback(|rejection| rejection.problem_response()).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{reply:?}");
    assert_eq!(reply.code(), "locking.invalid_key");
}

#[tokio::test]
async fn a_mapper_answers_its_own_response_and_the_rejection_itself_for_the_rest() {
    // The documented problem document, as the layer's default would send it.
    let reply = mapper_with_fallback(IntoResponse::into_response).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{reply:?}");
    let problem = reply.problem();
    assert_eq!(problem["code"], "locking.invalid_key");
    assert_eq!(problem["type"], "about:blank");
    assert_eq!(problem["title"], "Bad Request");
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
    reply.assert_busy_without("widgets");
    held.release().await.expect("release");
}
