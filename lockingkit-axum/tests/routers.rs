//! Lock layers on composed routers (`merge`, `nest`, `nest_service`) added with `Router::layer`:
//! a path that matches no route keeps the router's answer, and matched routes stay locked.

use crate::support;

use axum::routing::{get, post};
use axum::Router;
use http::StatusCode;
use lockingkit::DistributedLock;
use lockingkit_axum::lock_route;

use support::{get as http_get, guarded, post as http_post, serve, ship_router, show_lock, Reply};

fn assert_not_found(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{reply:?}");
    assert!(
        reply.body.is_empty(),
        "axum's own 404, not a problem: {reply:?}"
    );
}

/// Holds `key`, checks that `path` is refused as busy, then that it is served once released.
async fn assert_locked(addr: std::net::SocketAddr, locks: &DistributedLock, key: &str, path: &str) {
    let held = locks
        .try_acquire(key)
        .await
        .expect("the test holds the key");
    let reply = guarded(http_post(addr, path)).await;
    assert_eq!(reply.status, StatusCode::CONFLICT, "{path}: {reply:?}");
    assert_eq!(reply.code(), "locking.busy");
    held.release().await.expect("release");
    let reply = guarded(http_post(addr, path)).await;
    assert_eq!(reply.status, StatusCode::OK, "{path}: {reply:?}");
    assert!(reply.text().starts_with(&format!("{key} ")), "{reply:?}");
}

#[tokio::test]
async fn router_layer_on_a_merged_router_keeps_404_for_unknown_paths_and_locks_its_routes() {
    let locks = DistributedLock::in_memory();
    let shipping = Router::new().route("/orders/{id}/ship", post(show_lock));
    let payments = Router::new().route("/orders/{id}/pay", post(show_lock));
    let app = Router::new()
        .merge(shipping)
        .merge(payments)
        .layer(lock_route(locks.clone(), "orders/{id}"));
    let addr = serve(app).await;

    for path in ["/", "/nowhere", "/orders/1/refund", "/orders/1/ship/extra"] {
        assert_not_found(&guarded(http_post(addr, path)).await);
        assert_not_found(&guarded(http_get(addr, path)).await);
    }
    assert_locked(addr, &locks, "orders/5", "/orders/5/ship").await;
    assert_locked(addr, &locks, "orders/6", "/orders/6/pay").await;
}

#[tokio::test]
async fn router_layer_over_a_custom_fallback_leaves_the_fallback_answer_alone() {
    let locks = DistributedLock::in_memory();
    let app = ship_router()
        .fallback(|| async { (StatusCode::IM_A_TEAPOT, "no such page") })
        .layer(lock_route(locks.clone(), "orders/{id}"));
    let addr = serve(app).await;

    let reply = guarded(http_post(addr, "/nowhere")).await;
    assert_eq!(reply.status, StatusCode::IM_A_TEAPOT, "{reply:?}");
    assert_eq!(reply.text(), "no such page");
    assert_locked(addr, &locks, "orders/2", "/orders/2/ship").await;
}

#[tokio::test]
async fn router_layer_on_a_nested_router_keeps_404_for_unknown_paths_and_locks_its_routes() {
    let locks = DistributedLock::in_memory();
    let tenant = Router::new().route("/orders/{id}/ship", post(show_lock));
    let app = Router::new()
        .nest("/tenants/{tenant}", tenant)
        .route(
            "/health",
            get(|| async { "ok" }).route_layer(lock_route(locks.clone(), "health")),
        )
        .layer(lock_route(locks.clone(), "tenants/{tenant}/orders/{id}"));
    let addr = serve(app).await;

    for path in [
        "/nowhere",
        "/tenants/acme",
        "/tenants/acme/nowhere",
        "/tenants/acme/orders/1",
    ] {
        assert_not_found(&guarded(http_post(addr, path)).await);
    }
    assert_locked(
        addr,
        &locks,
        "tenants/acme/orders/7",
        "/tenants/acme/orders/7/ship",
    )
    .await;
}

#[tokio::test]
async fn a_layered_router_nested_as_a_service_keeps_404_for_unknown_paths() {
    let locks = DistributedLock::in_memory();
    let api = ship_router().layer(lock_route(locks.clone(), "orders/{id}"));
    let app = Router::new().nest_service("/api", api);
    let addr = serve(app).await;

    // Not "/api" itself: `nest_service` registers it as a route of the outer router, so axum
    // reports it as matched (`MatchedPath` "/api") even where the nested router has no "/".
    for path in ["/api/nowhere", "/api/orders/1", "/nowhere"] {
        assert_not_found(&guarded(http_post(addr, path)).await);
    }
    assert_locked(addr, &locks, "orders/8", "/api/orders/8/ship").await;
}

#[tokio::test]
async fn router_layer_still_refuses_a_matched_route_that_lacks_a_template_parameter() {
    // Serving such a route unlocked would turn a typo in a template into a silent loss of
    // mutual exclusion; the layer refuses it as the server bug it is and logs the missing
    // parameter instead.
    let locks = DistributedLock::in_memory();
    let app = ship_router()
        .route("/orders/{order_id}/pay", post(show_lock))
        .layer(lock_route(locks.clone(), "orders/{id}"));
    let addr = serve(app).await;

    let reply = guarded(http_post(addr, "/orders/3/pay")).await;
    assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
    assert_eq!(reply.code(), "locking.misconfigured");
    assert_not_found(&guarded(http_post(addr, "/orders/3/refund")).await);
}
