//! What the tower layer's tests share: real HTTP on 127.0.0.1 (a hyper server driving a tower
//! service, a hyper client, a body that streams what the test sends), the hang guard, the path
//! key and a lock with short leases.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST, RETRY_AFTER};
use http::request::Parts;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use lockingkit::{DistributedLock, MemoryBackend, MemoryStore};
use lockingkit_tower::LockLayer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tower::{Layer, Service};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A bound on how long a test may hang if the code under test deadlocks; never a way to wait
/// for something to happen.
pub const HANG_GUARD: Duration = Duration::from_secs(20);

/// `future`, failing the test if it hangs past [`HANG_GUARD`].
pub async fn guarded<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(HANG_GUARD, future)
        .await
        .expect("the test hung")
}

/// The key of a request is its path: "/orders/42" locks "orders/42".
pub fn path_key(parts: &Parts) -> Option<String> {
    Some(parts.uri.path().trim_start_matches('/').to_owned())
}

/// An in-memory lock on `store` whose 300 ms leases make renewals notice a broken lease quickly.
pub fn short_lease_locks(store: &MemoryStore) -> DistributedLock {
    DistributedLock::builder(MemoryBackend::with_lease(
        store.clone(),
        Duration::from_millis(300),
    ))
    .build()
    .expect("lock provider")
}

/// Serves `service` with hyper's HTTP/1.1 server on a free loopback port.
pub async fn serve<S, B>(service: S) -> SocketAddr
where
    S: Service<Request<Incoming>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// Serves `service` behind `layer`, as [`serve`] does.
pub async fn serve_behind<S, B>(layer: LockLayer, service: S) -> SocketAddr
where
    S: Service<Request<Incoming>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError> + Send,
    B: Body + Send + 'static,
    B::Data: From<Bytes> + Send,
    B::Error: Into<BoxError>,
{
    serve(layer.layer(service)).await
}

/// Sends one request on a fresh connection and returns the response as soon as its head
/// arrives; the body streams on.
pub async fn send(addr: SocketAddr, method: Method, path: &str) -> Response<Incoming> {
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
    sender.send_request(request).await.expect("response head")
}

/// A response as the client saw it, body read to the end.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub content_type: Option<String>,
    pub retry_after: Option<String>,
    pub body: Bytes,
}

impl Reply {
    /// The problem document's `code`, checking that the reply is one.
    pub fn code(&self) -> String {
        assert_eq!(
            self.content_type.as_deref(),
            Some("application/problem+json"),
            "{self:?}"
        );
        let doc: serde_json::Value = serde_json::from_slice(&self.body).expect("JSON");
        assert_eq!(doc["status"], self.status.as_u16());
        doc["code"].as_str().expect("code").to_owned()
    }
}

/// Sends one request on a fresh connection and reads the whole response.
pub async fn call(addr: SocketAddr, method: Method, path: &str) -> Reply {
    let response = send(addr, method, path).await;
    let header = |name| {
        response
            .headers()
            .get(name)
            .map(|value: &HeaderValue| value.to_str().unwrap_or_default().to_owned())
    };
    let (status, content_type, retry_after) =
        (response.status(), header(CONTENT_TYPE), header(RETRY_AFTER));
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    Reply {
        status,
        content_type,
        retry_after,
        body,
    }
}

/// A response body that yields whatever the test sends, and ends when the sender is dropped.
pub struct ChannelBody(pub mpsc::UnboundedReceiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|data| Ok(Frame::data(data))))
    }
}
