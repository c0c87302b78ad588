//! A locked axum route on a real server and a keep-alive HTTP/1.1 client, for the HTTP shape
//! on PostgreSQL (a test and a benchmark row).

use std::net::SocketAddr;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use lockingkit::DistributedLock;
use tokio::net::{TcpListener, TcpStream};

/// `POST /orders/{id}` answering 200 after `handler`; locked per order when `locks` is given.
pub fn orders_route<F, Fut>(locks: Option<DistributedLock>, handler: F) -> Router
where
    F: Fn() -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let route = Router::new().route(
        "/orders/{id}",
        post(move || {
            let handler = handler.clone();
            async move {
                handler().await;
                StatusCode::OK
            }
        }),
    );
    match locks {
        Some(locks) => route.route_layer(lockingkit_axum::lock_route(locks, "orders/{id}")),
        None => route,
    }
}

/// Serves `app` on a free loopback port until the runtime ends.
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

/// One keep-alive HTTP/1.1 connection.
pub struct Connection {
    addr: SocketAddr,
    sender: hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
}

impl Connection {
    pub async fn open(addr: SocketAddr) -> Connection {
        let stream = TcpStream::connect(addr).await.expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("handshake");
        tokio::spawn(connection);
        Connection { addr, sender }
    }

    /// Sends `POST path` and reads the whole answer; returns its status.
    pub async fn post(&mut self, path: &str) -> StatusCode {
        self.sender.ready().await.expect("connection ready");
        let request = Request::post(path)
            .header(http::header::HOST, self.addr.to_string())
            .body(Empty::<Bytes>::new())
            .expect("request");
        let response = self.sender.send_request(request).await.expect("response");
        let status = response.status();
        response.into_body().collect().await.expect("body");
        status
    }
}

/// Requests per second of a locked route and of the same route without the layer.
#[derive(Clone, Copy, Debug, Default)]
pub struct LayerCost {
    pub locked_per_s: f64,
    pub plain_per_s: f64,
}

impl LayerCost {
    pub fn ratio(&self) -> f64 {
        self.locked_per_s / self.plain_per_s
    }
}

/// The cost of the lock layer itself: a no-op `POST /orders/{id}` behind
/// `lock_route("orders/{id}")` on the in-memory lock, against the same router without the
/// layer, both served over loopback. `rounds` rounds of each alternate, `length` each, on
/// `connections` keep-alive connections sending distinct ids, so no request ever waits.
pub async fn in_memory_layer_cost(
    connections: usize,
    rounds: usize,
    length: std::time::Duration,
) -> LayerCost {
    let locked = serve(orders_route(Some(DistributedLock::in_memory()), || async {})).await;
    let plain = serve(orders_route(None, || async {})).await;
    let warm = std::time::Duration::from_millis(200);
    posts_for(locked, connections, warm, "warm").await;
    posts_for(plain, connections, warm, "warm").await;
    let (mut locked_done, mut plain_done) = (0, 0);
    for round in 0..rounds {
        locked_done += posts_for(locked, connections, length, &format!("r{round}")).await;
        plain_done += posts_for(plain, connections, length, &format!("r{round}")).await;
    }
    let seconds = length.as_secs_f64() * rounds as f64;
    LayerCost {
        locked_per_s: locked_done as f64 / seconds,
        plain_per_s: plain_done as f64 / seconds,
    }
}

/// Sends `POST /orders/{tag}-{connection}-{n}` on `connections` connections for `length`;
/// returns how many were answered, each of them `200`.
async fn posts_for(
    addr: SocketAddr,
    connections: usize,
    length: std::time::Duration,
    tag: &str,
) -> u64 {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..connections {
        let stop = stop.clone();
        let prefix = format!("/orders/{tag}-{c}-");
        clients.spawn(async move {
            let mut connection = Connection::open(addr).await;
            let mut sent = 0u64;
            let mut path = String::with_capacity(prefix.len() + 20);
            while !stop.load(Ordering::Relaxed) {
                path.clear();
                path.push_str(&prefix);
                path.push_str(&sent.to_string());
                let status = connection.post(&path).await;
                assert_eq!(status, StatusCode::OK, "every id is free");
                sent += 1;
            }
            sent
        });
    }
    tokio::time::sleep(length).await;
    stop.store(true, Ordering::Relaxed);
    let mut answered = 0;
    while let Some(sent) = clients.join_next().await {
        answered += sent.expect("a client task panicked");
    }
    answered
}
