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

/// Requests per second of a locked route and of the same route without the layer, and what
/// each request cost this process (server and client together).
#[derive(Clone, Debug, Default)]
pub struct RouteRates {
    /// Requests per second behind the layer, over every round.
    pub locked_per_s: f64,
    /// Requests per second without it, over every round.
    pub plain_per_s: f64,
    /// Each round's locked requests over the plain requests of the round next to it.
    pub round_ratios: Vec<f64>,
    /// This process's CPU per locked request.
    pub locked_cpu: Duration,
    /// This process's CPU per plain request.
    pub plain_cpu: Duration,
    /// Heap allocations per locked request (0 unless the program counts them, see
    /// [`allocations`](crate::allocations)).
    pub locked_allocations: f64,
    /// Heap allocations per plain request.
    pub plain_allocations: f64,
}

impl RouteRates {
    /// The median of the rounds' ratios: the locked route's requests per second over the plain
    /// one's, each round set against its neighbour so that both meet the same machine.
    pub fn ratio(&self) -> f64 {
        let mut ratios = self.round_ratios.clone();
        ratios.sort_by(f64::total_cmp);
        match ratios.len() {
            0 => self.locked_per_s / self.plain_per_s,
            n if n % 2 == 1 => ratios[n / 2],
            n => (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0,
        }
    }
}

/// What one side's rounds served and cost: requests, CPU, allocations.
#[derive(Clone, Copy, Default)]
struct Spent {
    requests: u64,
    cpu: Duration,
    allocations: u64,
}

impl Spent {
    /// Runs `side` and adds what it served and cost.
    async fn add(&mut self, side: impl std::future::Future<Output = u64>) -> u64 {
        let (cpu, allocations) = (own_cpu_time(), crate::allocations::allocations());
        let requests = side.await;
        self.requests += requests;
        self.cpu += own_cpu_time().saturating_sub(cpu);
        self.allocations += crate::allocations::allocations().saturating_sub(allocations);
        requests
    }

    fn cpu_per_request(&self) -> Duration {
        self.cpu
            .checked_div(u32::try_from(self.requests.max(1)).unwrap_or(u32::MAX))
            .unwrap_or_default()
    }

    fn allocations_per_request(&self) -> f64 {
        self.allocations as f64 / self.requests.max(1) as f64
    }
}

/// Alternates `rounds` rounds of the locked side (`side(true, round)`) and the plain one, each
/// `length` long and answering how many requests it served: the locked side first in even
/// rounds and second in odd ones, so that neither always follows the other.
async fn alternate_rounds<F, Fut>(rounds: usize, length: Duration, mut side: F) -> RouteRates
where
    F: FnMut(bool, usize) -> Fut,
    Fut: std::future::Future<Output = u64>,
{
    let (mut locked, mut plain) = (Spent::default(), Spent::default());
    let mut round_ratios = Vec::with_capacity(rounds);
    crate::allocations::counting(true);
    for round in 0..rounds {
        let (locked_now, plain_now) = if round % 2 == 0 {
            let locked_now = locked.add(side(true, round)).await;
            (locked_now, plain.add(side(false, round)).await)
        } else {
            let plain_now = plain.add(side(false, round)).await;
            (locked.add(side(true, round)).await, plain_now)
        };
        round_ratios.push(locked_now as f64 / plain_now.max(1) as f64);
    }
    crate::allocations::counting(false);
    let seconds = length.as_secs_f64() * rounds as f64;
    RouteRates {
        locked_per_s: locked.requests as f64 / seconds,
        plain_per_s: plain.requests as f64 / seconds,
        round_ratios,
        locked_cpu: locked.cpu_per_request(),
        plain_cpu: plain.cpu_per_request(),
        locked_allocations: locked.allocations_per_request(),
        plain_allocations: plain.allocations_per_request(),
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
    alternate_rounds(rounds, length, |is_locked, round| {
        let addr = if is_locked { locked } else { plain };
        let tag = format!("r{round}");
        async move { posts_for(addr, connections, length, &tag).await }
    })
    .await
}

/// Requests per second, and CPU and allocations per request, of a route with and without the
/// lock layer, and the PostgreSQL server's CPU per locked request.
#[derive(Clone, Debug, Default)]
pub struct HttpShape {
    /// Requests per second behind `lock_route` on PostgreSQL, and without the layer, with this
    /// process's CPU and allocations per request on each side.
    pub rates: RouteRates,
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
    // The server's CPU while the locked side ran, and the requests it served meanwhile.
    let server_side = std::sync::Mutex::new(Spent::default());
    let rates = alternate_rounds(rounds, length, |is_locked, round| {
        let server_side = &server_side;
        async move {
            if !is_locked {
                return posts_for(plain, connections, length, "plain").await;
            }
            let before = server.cpu_time();
            let done = posts_for(locked, connections, length, &format!("r{pid}-{round}")).await;
            let mut spent = server_side
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            spent.cpu += server.cpu_time().saturating_sub(before);
            spent.requests += done;
            done
        }
    })
    .await;
    let server_side = server_side
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    HttpShape {
        rates,
        locked_server_cpu: server_side.cpu_per_request(),
    }
}
