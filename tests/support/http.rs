//! A locked axum route on a real server and a keep-alive HTTP/1.1 client, for the HTTP shape
//! on PostgreSQL (a test here, and the HTTP rows of `lockingkit-benches`).

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
