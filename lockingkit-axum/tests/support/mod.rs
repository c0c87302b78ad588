//! What the axum tests share: a real HTTP client and server on 127.0.0.1, the hang guard, the
//! handler that shows its lock, the route most tests lock, and a lock with short leases.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::Request as AxumRequest;
use axum::response::IntoResponse;
use axum::routing::{post as route_post, Route};
use axum::Router;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST, RETRY_AFTER};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use lockingkit::{DistributedLock, MemoryBackend, MemoryStore};
use lockingkit_axum::HeldLock;
use tokio::net::{TcpListener, TcpStream};
use tower::{Layer, Service};

/// A bound on how long a test may hang if the code under test deadlocks; never a way to wait
/// for something to happen.
pub const HANG_GUARD: Duration = Duration::from_secs(20);

/// `future`, failing the test if it hangs past [`HANG_GUARD`].
pub async fn guarded<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(HANG_GUARD, future)
        .await
        .expect("the test hung")
}

/// A handler that answers with its lock's key and fencing token, "orders/7 3".
pub async fn show_lock(lock: HeldLock) -> String {
    format!("{} {}", lock.key(), lock.fencing_token())
}

/// Serves `POST /orders/{id}/ship`, answered by [`show_lock`], behind `layer` (a route layer).
pub async fn serve_ship_route<L>(layer: L) -> SocketAddr
where
    L: Layer<Route> + Clone + Send + Sync + 'static,
    L::Service: Service<AxumRequest> + Clone + Send + Sync + 'static,
    <L::Service as Service<AxumRequest>>::Response: IntoResponse + 'static,
    <L::Service as Service<AxumRequest>>::Error: Into<Infallible> + 'static,
    <L::Service as Service<AxumRequest>>::Future: Send + 'static,
{
    serve(ship_router().route_layer(layer)).await
}

/// `POST /orders/{id}/ship`, answered by [`show_lock`], unlocked.
pub fn ship_router() -> Router {
    Router::new().route("/orders/{id}/ship", route_post(show_lock))
}

/// In-memory locks on `store` with 300 ms leases, so that renewals (every 100 ms) notice a
/// broken lease quickly.
pub fn short_lease_locks(store: &MemoryStore) -> DistributedLock {
    DistributedLock::builder(MemoryBackend::with_lease(
        store.clone(),
        Duration::from_millis(300),
    ))
    .build()
    .expect("lock provider")
}

/// Serves `app` on a free loopback port until the test's runtime ends.
pub async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// A complete response as the client saw it.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The problem document, after checking the media type.
    pub fn problem(&self) -> serde_json::Value {
        assert_eq!(
            self.headers.get(CONTENT_TYPE).map(|v| v.to_str().unwrap()),
            Some("application/problem+json"),
            "not a problem document: {self:?}"
        );
        let doc: serde_json::Value =
            serde_json::from_slice(&self.body).expect("problem document is JSON");
        assert_eq!(doc["status"], self.status.as_u16(), "{doc}");
        doc
    }

    pub fn code(&self) -> String {
        self.problem()["code"].as_str().expect("code").to_owned()
    }

    pub fn retry_after(&self) -> Option<String> {
        self.headers
            .get(RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_owned())
    }

    /// Checks that this is the default answer to a busy lock: `409 Conflict` with code
    /// `locking.busy` and `Retry-After: 1`, naming nothing of `key`.
    pub fn assert_busy_without(&self, key: &str) {
        assert_eq!(self.status, StatusCode::CONFLICT, "{self:?}");
        let problem = self.problem();
        assert_eq!(problem["code"], "locking.busy");
        assert_eq!(problem["title"], "Conflict");
        assert!(!self.text().contains(key), "the key leaked: {self:?}");
        assert_eq!(self.retry_after().as_deref(), Some("1"));
    }
}

/// Sends one request on a fresh HTTP/1.1 connection and reads the whole response.
pub async fn send(addr: SocketAddr, method: Method, path: &str) -> Reply {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, addr.to_string())
        .body(Empty::<Bytes>::new())
        .expect("request");
    let response = sender.send_request(request).await.expect("response head");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("response body").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn post(addr: SocketAddr, path: &str) -> Reply {
    send(addr, Method::POST, path).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    send(addr, Method::GET, path).await
}
