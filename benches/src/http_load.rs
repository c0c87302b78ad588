//! The HTTP rows, on the fixture's route and client (`lockingkit_tests::http`): `POST
//! /orders/{id}` (a no-op handler) behind `lock_route` next to the same route without a layer,
//! keep-alive connections sending distinct ids, rounds of each alternating.
//!
//! - **HTTP shape** (row 8): the lock on PostgreSQL, with the CPU this process and the server
//!   used per request;
//! - **layer cost** (row 9): the in-memory lock, so what remains is the layer's own cost.

use std::net::SocketAddr;
use std::time::Duration;

use http::StatusCode;
use lockingkit::DistributedLock;
use lockingkit_tests::http::{orders_route, serve, Connection};
use lockingkit_tests::postgres::{own_cpu_time, PostgresServer};

use crate::load::{tasks_for, WARM_UP};
use crate::pair::lock_on;
use crate::postgres_pairs::backend;
use crate::postgres_throughput::lockingkit_options;

/// Sends `POST /orders/{tag}-{connection}-{n}` on `connections` keep-alive connections for
/// `length`; returns how many were answered, each of them `200`.
async fn posts_for(addr: SocketAddr, connections: usize, length: Duration, tag: &str) -> u64 {
    tasks_for(connections, length, |c, running| {
        let prefix = format!("/orders/{tag}-{c}-");
        async move {
            let mut connection = Connection::open(addr).await;
            let mut sent = 0u64;
            let mut path = String::with_capacity(prefix.len() + 20);
            while running.goes_on() {
                path.clear();
                path.push_str(&prefix);
                path.push_str(&sent.to_string());
                let status = connection.post(&path).await;
                assert_eq!(status, StatusCode::OK, "every id is free");
                sent += 1;
            }
            sent
        }
    })
    .await
}

/// Requests per second of a locked route and of the same route without the layer.
#[derive(Clone, Copy, Debug, Default)]
pub struct RouteRates {
    /// Requests per second behind the layer.
    pub locked_per_s: f64,
    /// Requests per second without it.
    pub plain_per_s: f64,
}

impl RouteRates {
    /// The locked route's requests per second over the plain one's.
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
    length: Duration,
) -> RouteRates {
    let locked = serve(orders_route(Some(DistributedLock::in_memory()), || async {})).await;
    let plain = serve(orders_route(None, || async {})).await;
    posts_for(locked, connections, WARM_UP, "warm").await;
    posts_for(plain, connections, WARM_UP, "warm").await;
    let (mut locked_done, mut plain_done) = (0, 0);
    for round in 0..rounds {
        locked_done += posts_for(locked, connections, length, &format!("r{round}")).await;
        plain_done += posts_for(plain, connections, length, &format!("r{round}")).await;
    }
    let seconds = length.as_secs_f64() * rounds as f64;
    RouteRates {
        locked_per_s: locked_done as f64 / seconds,
        plain_per_s: plain_done as f64 / seconds,
    }
}

/// Requests per second and CPU per request of a route with and without the lock layer.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpShape {
    /// Requests per second behind `lock_route` on PostgreSQL, and without the layer.
    pub rates: RouteRates,
    /// CPU of this process (server and client) per locked request.
    pub locked_app_cpu: Duration,
    /// CPU of this process (server and client) per plain request.
    pub plain_app_cpu: Duration,
    /// CPU of the PostgreSQL server per locked request.
    pub locked_server_cpu: Duration,
}

/// Alternates `rounds` rounds of the locked (on `server`) and the plain route, `length` each,
/// on `connections` connections.
pub async fn http_shape(
    server: &PostgresServer,
    connections: usize,
    rounds: usize,
    length: Duration,
) -> HttpShape {
    let locks = lock_on(backend(lockingkit_options(server)));
    let locked = serve(orders_route(Some(locks), || async {})).await;
    let plain = serve(orders_route(None, || async {})).await;
    let pid = std::process::id();
    posts_for(locked, connections, WARM_UP, &format!("warm{pid}")).await;
    posts_for(plain, connections, WARM_UP, "warm").await;
    let mut shape = HttpShape::default();
    let (mut locked_done, mut plain_done) = (0, 0);
    let (mut locked_cpu, mut plain_cpu, mut server_cpu) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for round in 0..rounds {
        let (app, db) = (own_cpu_time(), server.cpu_time());
        locked_done += posts_for(locked, connections, length, &format!("r{pid}-{round}")).await;
        locked_cpu += own_cpu_time().saturating_sub(app);
        server_cpu += server.cpu_time().saturating_sub(db);
        let app = own_cpu_time();
        plain_done += posts_for(plain, connections, length, "plain").await;
        plain_cpu += own_cpu_time().saturating_sub(app);
    }
    let seconds = length.as_secs_f64() * rounds as f64;
    shape.rates = RouteRates {
        locked_per_s: locked_done as f64 / seconds,
        plain_per_s: plain_done as f64 / seconds,
    };
    let per = |cpu: Duration, n: u64| cpu.checked_div(n.max(1) as u32).unwrap_or_default();
    shape.locked_app_cpu = per(locked_cpu, locked_done);
    shape.plain_app_cpu = per(plain_cpu, plain_done);
    shape.locked_server_cpu = per(server_cpu, locked_done);
    shape
}
