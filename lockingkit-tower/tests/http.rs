//! `LockLayer` behind hyper's own server (no framework) over real HTTP on 127.0.0.1.

use crate::support;

use std::convert::Infallible;

use bytes::Bytes;
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use lockingkit::{DistributedLock, ErrorKind, LockView, MemoryStore};
use lockingkit_tower::LockLayer;
use tokio::sync::mpsc;
use tower::{service_fn, ServiceBuilder};

use support::{call, guarded, path_key, send, serve, serve_behind, short_lease_locks, ChannelBody};

type Body = BoxBody<Bytes, Infallible>;

fn text(body: impl Into<Bytes>) -> Response<Body> {
    Response::new(Full::new(body.into()).boxed())
}

/// Serves, behind `layer`, a handler that streams a body the test feeds; sends `GET path` and
/// returns the response as soon as its head arrives, with the sender of its body.
async fn stream_through(
    layer: LockLayer,
    path: &str,
) -> (Response<Incoming>, mpsc::UnboundedSender<Bytes>) {
    let (senders_tx, mut senders) = mpsc::unbounded_channel();
    let handler = service_fn(move |_request: Request<Incoming>| {
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = senders_tx.send(tx);
        async move { Ok::<_, Infallible>(Response::new(ChannelBody(rx).boxed())) }
    });
    let addr = serve_behind(layer, handler).await;
    let response = guarded(send(addr, Method::GET, path)).await;
    let body_tx = guarded(senders.recv()).await.expect("handler ran");
    (response, body_tx)
}

#[tokio::test]
async fn a_plain_hyper_server_serves_the_locked_service() {
    let locks = DistributedLock::in_memory();
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(locks.clone(), path_key))
        .service(service_fn(|request: Request<Incoming>| async move {
            let lock = request.extensions().get::<LockView>().cloned();
            let token = lock.map_or(0, |lock| lock.fencing_token());
            Ok::<_, Infallible>(text(format!("token {token}")))
        }));
    let addr = serve(service).await;

    let reply = guarded(call(addr, Method::POST, "/orders/1")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(&reply.body[..], b"token 1");

    let held = locks.try_acquire("orders/1").await.expect("free");
    let reply = guarded(call(addr, Method::POST, "/orders/1")).await;
    assert_eq!(reply.status, StatusCode::CONFLICT);
    // `code()` checks the problem+json content type too.
    assert_eq!(reply.code(), "locking.busy");
    held.release().await.expect("release");
}

/// Takes and gives back `key` on `locks`: nobody holds it.
async fn assert_free(locks: &DistributedLock, key: &str) {
    let handle = locks
        .try_acquire(key)
        .await
        .unwrap_or_else(|error| panic!("{key} is not free: {error}"));
    handle.release().await.expect("release");
}

#[tokio::test]
async fn by_default_the_lock_is_released_before_a_streamed_body_starts() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let layer = LockLayer::new(locks.clone(), path_key);
    let (response, body_tx) = stream_through(layer, "/reports/1").await;
    assert_eq!(response.status(), StatusCode::OK);
    assert!(!store.is_locked("reports/1"), "released with the head");
    drop(body_tx);
    guarded(response.into_body().collect()).await.expect("body");
}

#[tokio::test]
async fn hold_until_body_ends_keeps_the_lock_until_the_last_frame() {
    let store = MemoryStore::new();
    let locks = DistributedLock::in_memory_shared(&store);
    let layer = LockLayer::new(locks.clone(), path_key).hold_until_body_ends();
    let (response, body_tx) = stream_through(layer, "/reports/2").await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();

    body_tx.send(Bytes::from_static(b"part 1")).expect("send");
    let frame = guarded(body.frame()).await.expect("frame").expect("data");
    assert_eq!(frame.into_data().expect("data"), "part 1");
    let busy = locks
        .try_acquire("reports/2")
        .await
        .expect_err("held while streaming");
    assert_eq!(busy.kind(), ErrorKind::Busy);

    drop(body_tx);
    guarded(body.collect()).await.expect("rest of the body");
    // The layer released before it reported the end of the body.
    assert!(!store.is_locked("reports/2"));
    assert_free(&locks, "reports/2").await;
}

#[tokio::test]
async fn losing_the_lock_while_streaming_breaks_the_body() {
    let store = MemoryStore::new();
    let locks = short_lease_locks(&store);
    let layer = LockLayer::new(locks.clone(), path_key).hold_until_body_ends();
    let (response, body_tx) = stream_through(layer, "/reports/3").await;
    let mut body = response.into_body();
    body_tx.send(Bytes::from_static(b"part 1")).expect("send");
    guarded(body.frame()).await.expect("frame").expect("data");

    assert!(store.break_lease("reports/3"));
    // The server stops streaming: it drops the inner body …
    guarded(body_tx.closed()).await;
    // … and the client sees a broken response, not a complete-looking one.
    let rest = guarded(body.collect()).await;
    assert!(rest.is_err(), "the body must fail, got {rest:?}");
    assert_free(&locks, "reports/3").await;
}

#[tokio::test]
async fn requests_without_a_key_are_400_unless_passed_through() {
    let locks = DistributedLock::in_memory();
    let writes_only = |parts: &Parts| {
        (parts.method == Method::POST)
            .then(|| path_key(parts))
            .flatten()
    };
    let handler = service_fn(|request: Request<Incoming>| async move {
        let locked = request.extensions().get::<LockView>().is_some();
        Ok::<_, Infallible>(text(if locked { "locked" } else { "unlocked" }))
    });
    let strict = serve_behind(LockLayer::new(locks.clone(), writes_only), handler).await;
    let lenient = LockLayer::new(locks, writes_only).pass_through_without_key();
    let lenient = serve_behind(lenient, handler).await;

    let reply = guarded(call(strict, Method::GET, "/orders/1")).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.code(), "locking.invalid_key");

    for (method, expected) in [(Method::GET, "unlocked"), (Method::POST, "locked")] {
        let reply = guarded(call(lenient, method, "/orders/1")).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(&reply.body[..], expected.as_bytes());
    }
}
