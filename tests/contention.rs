//! Contention on a healthy backend is contention, never an outage: routes that wait not at all
//! (`.wait(0)`) or briefly (`.wait(20 ms)`) on a contended key, against a real PostgreSQL and
//! a real Redis, answer `200` or `409`, and never `503 locking.unavailable`. A short wait ends
//! with the answer of an attempt (its own, or the one in flight for its key), which a healthy
//! backend gives: "busy".
//!
//! Each test prints its counts (`--nocapture`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use http::StatusCode;
use lockingkit::{DistributedLock, PostgresBackend, RedisBackend, RedisOptions};
use lockingkit_tests::http::{serve, Connection};
use lockingkit_tests::postgres::PostgresServer;
use lockingkit_tests::redis::RedisServer;

const CLIENTS: usize = 32;
const KEYS: usize = 2;
const LENGTH: Duration = Duration::from_secs(3);

/// `POST /{wait_ms}/keys/{id}` behind `lock_route("keys/{id}")` waiting `wait_ms` (0, 1, 5, 20
/// or 60 ms); the handler holds the lock for a millisecond, so keys are always contended.
fn routes(locks: DistributedLock) -> Router {
    let mut router = Router::new();
    for wait_ms in [0, 1, 5, 20, 60] {
        let layer = lockingkit_axum::lock_route(locks.clone(), "keys/{id}")
            .wait(Duration::from_millis(wait_ms));
        router = router.route(
            &format!("/{wait_ms}/keys/{{id}}"),
            post(|| async {
                tokio::time::sleep(Duration::from_millis(1)).await;
                StatusCode::OK
            })
            .route_layer(layer),
        );
    }
    router
}

/// Runs the clients for [`LENGTH`], each on one route and one of [`KEYS`] keys; returns the
/// statuses each wait was answered with.
async fn contend(locks: DistributedLock) -> BTreeMap<(u64, u16), usize> {
    let addr = serve(routes(locks)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let stop = stop.clone();
            let wait_ms = [0, 1, 5, 20, 60][client % 5];
            tokio::spawn(async move {
                let mut connection = Connection::open(addr).await;
                let path = format!("/{wait_ms}/keys/{}", client % KEYS);
                let mut answers = BTreeMap::new();
                while !stop.load(Ordering::Relaxed) {
                    let status = connection.post(&path).await.as_u16();
                    *answers.entry((wait_ms, status)).or_insert(0) += 1;
                }
                answers
            })
        })
        .collect();
    tokio::time::sleep(LENGTH).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = BTreeMap::new();
    for client in clients {
        for (answer, count) in client.await.expect("a client task") {
            *all.entry(answer).or_insert(0) += count;
        }
    }
    all
}

fn assert_contention_only(provider: &str, answers: &BTreeMap<(u64, u16), usize>) {
    eprintln!("{provider}: (wait ms, status) → answers: {answers:?}");
    assert!(
        answers
            .keys()
            .all(|(_, status)| matches!(status, 200 | 409)),
        "{provider}: a healthy, contended backend answered something else: {answers:?}"
    );
    // The keys were contended: the callers that do not wait were told so, many times.
    let busy = answers.get(&(0, 409)).copied().unwrap_or(0);
    assert!(
        busy > 100,
        "{provider}: contention was not met: {answers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_waits_on_a_contended_postgres_are_409_never_503() {
    let server = PostgresServer::start().await;
    let backend = PostgresBackend::new(server.options(Duration::from_secs(5))).expect("options");
    let locks = DistributedLock::builder(backend).build().expect("lock");
    assert_contention_only("postgres", &contend(locks).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_waits_on_a_contended_redis_are_409_never_503() {
    let server = RedisServer::start().await;
    let backend = RedisBackend::new(RedisOptions::new(server.url())).expect("options");
    let locks = DistributedLock::builder(backend).build().expect("lock");
    assert_contention_only("redis", &contend(locks).await);
}
