//! A real HTTP client and server on 127.0.0.1 for the HTTP tests.

#![allow(dead_code)]

use std::net::SocketAddr;

use axum::Router;
use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST, RETRY_AFTER};
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

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
