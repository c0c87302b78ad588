//! PostgreSQL at fleet scale, measured next to its baselines in one run: many locks at once on
//! the shared sessions, and a locked HTTP route.
//!
//! - **Throughput**: 256 tasks, each on keys of its own, doing `try_acquire` + `release` pairs
//!   as fast as they can, through one `DistributedLock` with the default session budget; next
//!   to the same tasks running raw prepared try-lock + unlock pairs over a pool of 16 dedicated
//!   connections (deadpool-postgres, one statement at a time per connection). Rounds of each
//!   alternate, and each side reports the connections it opened.
//! - **HTTP shape**: `POST /orders/{id}` (a no-op handler) with `lock_route` on PostgreSQL and
//!   the same route without a layer, 32 keep-alive connections sending distinct ids, rounds
//!   alternating; with the CPU this process and the server used per request.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lockingkit::keys::PostgresLockKeys;
use lockingkit::{DistributedLock, PostgresBackend, PostgresOptions};

use crate::bench::Percentiles;
use crate::bench_postgres::raw_pool;

/// Overrides the session budget of the throughput and HTTP rows, to compare budgets.
const SESSIONS_ENV: &str = "LOCKINGKIT_BENCH_MAX_SESSIONS";

/// The options of the LockingKit side: the defaults, unless [`SESSIONS_ENV`] says otherwise.
fn lockingkit_options(server: &PostgresServer) -> PostgresOptions {
    let mut options = PostgresOptions::new(server.connection_string());
    if let Some(sessions) = std::env::var(SESSIONS_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
    {
        options.max_sessions = sessions;
    }
    options
}
use crate::http::{orders_route, serve, Connection};
use crate::postgres::{own_cpu_time, PostgresServer};

/// Pairs per second on many keys at once, and the connections each side used.
#[derive(Clone, Copy, Debug, Default)]
pub struct Throughput {
    pub lockingkit_pairs_per_s: f64,
    pub lockingkit_connections: usize,
    pub raw_pairs_per_s: f64,
    pub raw_connections: usize,
}

impl Throughput {
    pub fn ratio(&self) -> f64 {
        self.lockingkit_pairs_per_s / self.raw_pairs_per_s
    }
}

/// Runs `tasks` tasks doing pairs through `pair` for `length`; returns the pairs done.
pub async fn pairs_for<F, Fut>(tasks: usize, length: Duration, pair: F) -> u64
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut running = tokio::task::JoinSet::new();
    for task in 0..tasks {
        let (done, stop, pair) = (done.clone(), stop.clone(), pair.clone());
        running.spawn(async move {
            let mut round = 0;
            while !stop.load(Ordering::Relaxed) {
                pair(task, round).await;
                round += 1;
                done.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    tokio::time::sleep(length).await;
    stop.store(true, Ordering::Relaxed);
    while let Some(result) = running.join_next().await {
        result.expect("a pair task panicked");
    }
    done.load(Ordering::Relaxed)
}

/// Alternates `rounds` rounds of LockingKit and raw pairs, `length` each, `tasks` at once.
pub async fn throughput(
    server: &PostgresServer,
    tasks: usize,
    rounds: usize,
    length: Duration,
) -> Throughput {
    let pid = std::process::id();
    let backend = PostgresBackend::new(lockingkit_options(server)).expect("options");
    let locks = DistributedLock::builder(backend).build().expect("lock");
    let pool = raw_pool(server, 16);

    let kit_pair = {
        let locks = locks.clone();
        move |task: usize, _round: u64| {
            let locks = locks.clone();
            async move {
                let key = format!("bench/throughput/{pid}/{task}");
                locks
                    .try_acquire(&key)
                    .await
                    .expect("a key of its own is free")
                    .release()
                    .await
                    .expect("release");
            }
        }
    };
    let raw_pair = {
        let pool = pool.clone();
        move |task: usize, _round: u64| {
            let pool = pool.clone();
            async move {
                let key =
                    PostgresLockKeys::advisory_key(&format!("bench/raw-throughput/{pid}/{task}"));
                let client = pool.get().await.expect("pooled connection");
                let lock = client
                    .prepare_cached("SELECT pg_try_advisory_lock($1)")
                    .await
                    .expect("prepare");
                let unlock = client
                    .prepare_cached("SELECT pg_advisory_unlock($1)")
                    .await
                    .expect("prepare");
                let taken: bool = client.query_one(&lock, &[&key]).await.expect("lock").get(0);
                assert!(taken, "a key of its own is free");
                let released: bool = client
                    .query_one(&unlock, &[&key])
                    .await
                    .expect("unlock")
                    .get(0);
                assert!(released);
            }
        }
    };
    // Warm-up: sessions open, statements prepared, the fencing sequence exists.
    pairs_for(tasks, Duration::from_millis(200), kit_pair.clone()).await;
    pairs_for(tasks, Duration::from_millis(200), raw_pair.clone()).await;
    let (mut kit, mut raw) = (0, 0);
    for _ in 0..rounds {
        kit += pairs_for(tasks, length, kit_pair.clone()).await;
        raw += pairs_for(tasks, length, raw_pair.clone()).await;
    }
    let seconds = length.as_secs_f64() * rounds as f64;
    let backend = locks
        .backend::<PostgresBackend>()
        .expect("a PostgreSQL backend");
    Throughput {
        lockingkit_pairs_per_s: kit as f64 / seconds,
        lockingkit_connections: backend.open_sessions(),
        raw_pairs_per_s: raw as f64 / seconds,
        raw_connections: pool.status().size,
    }
}

/// Requests per second and CPU per request of a route with and without the lock layer.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpShape {
    pub locked_per_s: f64,
    pub plain_per_s: f64,
    /// CPU of this process (server and client) per request, locked and plain.
    pub locked_app_cpu: Duration,
    pub plain_app_cpu: Duration,
    /// CPU of the PostgreSQL server per locked request.
    pub locked_server_cpu: Duration,
}

impl HttpShape {
    pub fn ratio(&self) -> f64 {
        self.locked_per_s / self.plain_per_s
    }
}

/// Sends POSTs with distinct ids on `connections` keep-alive connections for `length`.
async fn requests_for(addr: SocketAddr, connections: usize, length: Duration, tag: &str) -> u64 {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut running = tokio::task::JoinSet::new();
    for c in 0..connections {
        let (done, stop) = (done.clone(), stop.clone());
        let tag = tag.to_owned();
        running.spawn(async move {
            let mut connection = Connection::open(addr).await;
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let status = connection.post(&format!("/orders/{tag}-{c}-{i}")).await;
                assert_eq!(status, http::StatusCode::OK, "every id is free");
                i += 1;
                done.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    tokio::time::sleep(length).await;
    stop.store(true, Ordering::Relaxed);
    while let Some(result) = running.join_next().await {
        result.expect("a client task panicked");
    }
    done.load(Ordering::Relaxed)
}

/// Alternates `rounds` rounds of the locked and the plain route, `length` each.
pub async fn http_shape(
    server: &PostgresServer,
    connections: usize,
    rounds: usize,
    length: Duration,
) -> HttpShape {
    let backend = PostgresBackend::new(lockingkit_options(server)).expect("options");
    let locks = DistributedLock::builder(backend).build().expect("lock");
    let locked = serve(orders_route(Some(locks), || async {})).await;
    let plain = serve(orders_route(None, || async {})).await;
    let pid = std::process::id();
    requests_for(
        locked,
        connections,
        Duration::from_millis(200),
        &format!("warm{pid}"),
    )
    .await;
    requests_for(plain, connections, Duration::from_millis(200), "warm").await;
    let mut shape = HttpShape::default();
    let (mut locked_done, mut plain_done) = (0, 0);
    let (mut locked_cpu, mut plain_cpu, mut server_cpu) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for round in 0..rounds {
        let (app, db) = (own_cpu_time(), server.cpu_time());
        locked_done += requests_for(locked, connections, length, &format!("r{pid}-{round}")).await;
        locked_cpu += own_cpu_time().saturating_sub(app);
        server_cpu += server.cpu_time().saturating_sub(db);
        let app = own_cpu_time();
        plain_done += requests_for(plain, connections, length, "plain").await;
        plain_cpu += own_cpu_time().saturating_sub(app);
    }
    let seconds = length.as_secs_f64() * rounds as f64;
    shape.locked_per_s = locked_done as f64 / seconds;
    shape.plain_per_s = plain_done as f64 / seconds;
    let per = |cpu: Duration, n: u64| cpu.checked_div(n.max(1) as u32).unwrap_or_default();
    shape.locked_app_cpu = per(locked_cpu, locked_done);
    shape.plain_app_cpu = per(plain_cpu, plain_done);
    shape.locked_server_cpu = per(server_cpu, locked_done);
    shape
}

/// Cross-process hand-off while `waiter` waits for `keys` keys at once: each round `holder`
/// takes them all, one waiting task per key starts, and after a hold the keys are released one
/// by one; each sample is one key's release to its waiter holding it.
pub async fn handoff_of_many_keys(
    server: &PostgresServer,
    holder: &DistributedLock,
    waiter: &DistributedLock,
    prefix: &str,
    keys: usize,
    rounds: usize,
) -> Percentiles {
    let mut taken = Vec::with_capacity(keys * rounds);
    for round in 0..rounds {
        let names: Vec<String> = (0..keys).map(|k| format!("{prefix}/{k}")).collect();
        let mut held = Vec::new();
        for name in &names {
            held.push(holder.try_acquire(name).await.expect("holder lock"));
        }
        let waiting: Vec<_> = names
            .iter()
            .map(|name| {
                let waiter = waiter.clone();
                let name = name.clone();
                tokio::spawn(async move {
                    let handle = waiter.acquire(&name, Duration::from_secs(30)).await?;
                    let at = tokio::time::Instant::now();
                    handle.release().await.expect("release");
                    Ok::<_, lockingkit::LockError>(at)
                })
            })
            .collect();
        for name in &names {
            while waiter.waiting(name) == 0 {
                tokio::task::yield_now().await;
            }
        }
        tokio::time::sleep(Duration::from_millis(50 + (round as u64 * 389) % 700)).await;
        let mut released_at = Vec::new();
        for handle in held {
            released_at.push(tokio::time::Instant::now());
            handle.release().await.expect("release");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for ((released, task), name) in released_at.into_iter().zip(waiting).zip(&names) {
            match task.await.expect("waiter task") {
                Ok(acquired) => taken.push(acquired.saturating_duration_since(released)),
                Err(error) => {
                    let admin = server.connect().await;
                    let key = PostgresLockKeys::advisory_key(name);
                    let rows = admin
                        .query(
                            "SELECT l.pid, l.mode, l.granted, a.application_name, a.state, a.query \
                             FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                             WHERE l.locktype = 'advisory' \
                             AND ((l.classid::bigint << 32) | l.objid::bigint) = $1",
                            &[&key],
                        )
                        .await
                        .expect("pg_locks");
                    for row in rows {
                        eprintln!(
                            "pid {} {} granted={} app={} state={:?} query={:?}",
                            row.get::<_, i32>(0),
                            row.get::<_, String>(1),
                            row.get::<_, bool>(2),
                            row.get::<_, String>(3),
                            row.get::<_, Option<String>>(4),
                            row.get::<_, Option<String>>(5)
                        );
                    }
                    panic!("round {round}: {name} was not handed over: {error}");
                }
            }
        }
    }
    Percentiles::of(taken)
}
