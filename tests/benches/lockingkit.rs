//! LockingKit's performance goals, each measured next to its baseline in one run: starts a
//! throwaway PostgreSQL server, Azurite and Redis servers itself and prints a table, then one
//! JSON line.
//!
//! ```text
//! scripts/setup-postgres.sh && scripts/setup-azurite.sh && scripts/setup-redis.sh
//! cargo bench -p lockingkit-tests --bench lockingkit
//! ```
//!
//! Without `--bench` (`cargo test --all-targets`) every measurement runs a few samples as a
//! smoke test; it lists no tests to nextest.
//!
//! `cargo bench -p lockingkit-tests --bench lockingkit -- memory` runs only row 3 (in-memory
//! pairs), `cargo bench -p lockingkit-tests --bench lockingkit -- http-memory` only the row of
//! the HTTP layer's own cost (in-memory lock, no servers to start), `… -- transaction` only
//! row 11 (transaction-scoped try-lock, on a PostgreSQL server of its own), `-- redis` only
//! the Redis rows 12–14 (it starts a Redis server; `scripts/setup-redis.sh` installs it), and
//! `-- etcd` only the etcd rows (it starts its own one- and three-member clusters;
//! `scripts/setup-etcd.sh`); the full run prints the etcd rows after the table.

use std::time::Duration;

use lockingkit::{DistributedLock, PostgresBackend};
use lockingkit_tests::azurite::Azurite;
use lockingkit_tests::bench::{self, two_worker_runtime, BenchMode, Percentiles, PollingOnly};
use lockingkit_tests::bench_transaction::{self, TransactionBenchReport};
use lockingkit_tests::http::{in_memory_layer_cost, LayerCost};
use lockingkit_tests::postgres::PostgresServer;
use lockingkit_tests::redis::RedisServer;
use lockingkit_tests::{bench_azure, bench_etcd, bench_postgres, bench_redis, bench_sessions};

/// Sample counts: the real run, or a smoke test.
#[derive(Clone, Copy)]
struct Sizes {
    postgres_pairs: usize,
    redis_pairs: usize,
    azure_pairs: usize,
    memory_pairs: u32,
    cold_pairs: u32,
    local_handoffs: usize,
    remote_handoffs: usize,
    many_key_rounds: usize,
    /// Rounds of each side, and each round's length, for throughput and the HTTP shape.
    load_rounds: usize,
    load_round: Duration,
}

const FULL: Sizes = Sizes {
    postgres_pairs: 5000,
    redis_pairs: 5000,
    azure_pairs: 400,
    memory_pairs: 300_000,
    cold_pairs: 400,
    local_handoffs: 2000,
    remote_handoffs: 60,
    many_key_rounds: 8,
    load_rounds: 3,
    load_round: Duration::from_secs(2),
};

const SMOKE: Sizes = Sizes {
    postgres_pairs: 5,
    redis_pairs: 5,
    azure_pairs: 5,
    memory_pairs: 1000,
    cold_pairs: 3,
    local_handoffs: 5,
    remote_handoffs: 2,
    many_key_rounds: 1,
    load_rounds: 1,
    load_round: Duration::from_millis(100),
};

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn pass(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "MISSED"
    }
}

fn postgres_lock(server: &PostgresServer) -> DistributedLock {
    let backend = PostgresBackend::new(server.options(Duration::from_secs(30))).expect("options");
    DistributedLock::builder(backend).build().expect("lock")
}

fn polling_postgres_lock(server: &PostgresServer) -> DistributedLock {
    let backend = PostgresBackend::new(server.options(Duration::from_secs(30))).expect("options");
    DistributedLock::builder(PollingOnly(backend))
        .build()
        .expect("lock")
}

/// The patterns' rows: a multi-key hold of two keys vs two single holds in sequence on
/// PostgreSQL, and election failover (leader resigns → another provider's campaign leads) on
/// PostgreSQL and in memory, p50 over repeated runs.
fn patterns_rows(sizes: Sizes) {
    use lockingkit_tests::bench_patterns::{failover, multi_key_pair};
    let runtime = two_worker_runtime();
    runtime.block_on(async {
        tokio::spawn(async move {
            let server = PostgresServer::start().await;
            let locks = postgres_lock(&server);
            let (multi, singles) = multi_key_pair(&locks, sizes.postgres_pairs / 5).await;
            println!(
                "| multi-key pair (2 keys), PostgreSQL | p50 {:.3} ms | two single pairs in sequence p50 {:.3} ms |",
                ms(multi.p50),
                ms(singles.p50)
            );
            let follower = postgres_lock(&server);
            let pg = failover(|| postgres_lock(&server), &follower, sizes.remote_handoffs).await;
            let store = lockingkit::MemoryStore::new();
            let memory_follower = DistributedLock::in_memory_shared(&store);
            let memory = failover(
                || DistributedLock::in_memory_shared(&store),
                &memory_follower,
                sizes.remote_handoffs,
            )
            .await;
            println!(
                "| election failover (resign → other leads) | PostgreSQL p50 {:.1} ms | in-memory p50 {:.1} ms |",
                ms(pg.p50),
                ms(memory.p50)
            );
        })
        .await
        .expect("patterns rows");
    });
}

/// How far the attempts with 20 waiters may exceed those with one: retry delays are jittered,
/// so two runs with one waiter differ by a few percent as well.
const ATTEMPTS_JITTER: f64 = 1.05;

/// Keep-alive connections of the HTTP rows.
const HTTP_CONNECTIONS: usize = 32;

/// The row of the HTTP layer's own cost: a no-op route with and without `lock_route` on the
/// in-memory lock, interleaved in one run.
fn http_layer_cost(sizes: Sizes) -> LayerCost {
    two_worker_runtime().block_on(async {
        tokio::spawn(in_memory_layer_cost(
            HTTP_CONNECTIONS,
            sizes.load_rounds,
            sizes.load_round,
        ))
        .await
        .expect("the HTTP layer benchmark panicked")
    })
}

fn print_http_layer_cost(cost: &LayerCost) {
    println!(
        "| {:<52} | {:>10.0}/s | {:>10.0}/s | {:<14} | {:<6} |",
        "9. HTTP, lock_route in-memory vs no layer, no-op",
        cost.locked_per_s,
        cost.plain_per_s,
        format!("ratio {:.3}", cost.ratio()),
        pass(cost.ratio() >= 0.80)
    );
}

/// Row 11: the transaction-scoped try-lock against the raw statement, on a server of its own.
fn transaction_locks(runtime: &tokio::runtime::Runtime, sizes: Sizes) -> TransactionBenchReport {
    runtime.block_on(async {
        tokio::spawn(async move {
            let server = PostgresServer::start().await;
            bench_transaction::measure_transaction(&server, sizes.postgres_pairs).await
        })
        .await
        .expect("the transaction benchmark task panicked")
    })
}

fn print_transaction_locks(report: &TransactionBenchReport) {
    let row = |name: &str,
               ours: bench_postgres::Latency,
               baseline: bench_postgres::Latency,
               ratio: f64,
               goal: bool| {
        println!(
            "| {name:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<10} |",
            ms(ours.median),
            ms(baseline.median),
            format!("ratio {ratio:.3}"),
            if goal {
                pass(ratio <= 1.10)
            } else {
                "diagnostic"
            }
        );
    };
    row(
        "11. PostgreSQL transaction try-lock, unnamed vs raw",
        report.lockingkit_unnamed,
        report.raw_unnamed,
        report.unnamed_ratio(),
        true,
    );
    row(
        "11. same, deadpool (prepared) vs raw prepare_cached",
        report.lockingkit_prepared,
        report.raw_prepared,
        report.prepared_ratio(),
        true,
    );
    row(
        "   unnamed vs its own statement sent by hand",
        report.lockingkit_unnamed,
        report.same_unnamed,
        report.unnamed_library_ratio(),
        false,
    );
    row(
        "   prepared vs its own statement prepared by hand",
        report.lockingkit_prepared,
        report.same_prepared,
        report.prepared_library_ratio(),
        false,
    );
}

/// The etcd rows, on clusters of their own (`scripts/setup-etcd.sh`).
fn print_etcd(sizes: Sizes) {
    let etcd_sizes = bench_etcd::EtcdSizes {
        pairs: sizes.postgres_pairs / 5,
        handoffs: sizes.remote_handoffs,
        load: sizes.load_round,
    };
    let report = two_worker_runtime()
        .block_on(async { tokio::spawn(bench_etcd::measure(etcd_sizes)).await })
        .expect("the etcd rows");
    println!("{}", report.render());
    println!(
        "{{\"etcd_pair_ms\":{:.3},\"etcd_raw_pair_ms\":{:.3},\"etcd_pair_ratio\":{:.3},\"etcd_handoff_p50_ms\":{:.3},\"etcd_pairs_per_s\":{:.0},\"etcd_raw_pairs_per_s\":{:.0},\"etcd_connections\":{}}}",
        ms(report.pair),
        ms(report.raw_pair),
        report.pair_ratio(),
        ms(report.handoff.p50),
        report.kit_per_s,
        report.raw_per_s,
        report.connections
    );
}

/// The Redis rows, on a server of their own.
struct RedisRows {
    pairs: bench_redis::RedisPairs,
    throughput: bench_sessions::Throughput,
    polling: Percentiles,
    published: Percentiles,
}

fn redis_rows(sizes: Sizes) -> RedisRows {
    two_worker_runtime().block_on(async move {
        tokio::spawn(async move {
            let server = RedisServer::start().await;
            let pairs = bench_redis::measure(&server, sizes.redis_pairs).await;
            // A server of its own, whose clients are only the two sides being counted.
            let fresh = RedisServer::start().await;
            let throughput =
                bench_redis::throughput(&fresh, 256, sizes.load_rounds, sizes.load_round).await;
            drop(fresh);
            let holder = bench_redis::lock(&server);
            let polling = bench::cross_process_handoff(
                &holder,
                &bench_redis::polling_lock(&server),
                "handoff/redis/polling",
                sizes.remote_handoffs,
            )
            .await;
            let published = bench::cross_process_handoff(
                &holder,
                &bench_redis::lock(&server),
                "handoff/redis/published",
                sizes.remote_handoffs,
            )
            .await;
            RedisRows {
                pairs,
                throughput,
                polling,
                published,
            }
        })
        .await
        .expect("the Redis benchmark task panicked")
    })
}

fn print_redis_rows(rows: &RedisRows) {
    let pairs = &rows.pairs;
    println!(
        "| {:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<6} |",
        "12. Redis try_acquire+release vs same scripts raw",
        ms(pairs.lockingkit.p50),
        ms(pairs.raw.p50),
        format!("ratio {:.3}", pairs.ratio()),
        pass(pairs.ratio() <= 1.10)
    );
    println!(
        "| {:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<6} |",
        "   same, p99",
        ms(pairs.lockingkit.p99),
        ms(pairs.raw.p99),
        format!("ratio {:.3}", ms(pairs.lockingkit.p99) / ms(pairs.raw.p99)),
        ""
    );
    println!(
        "| {:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<6} |",
        "   RedisBackend alone (no engine) vs raw, median",
        ms(pairs.backend_only.p50),
        ms(pairs.raw.p50),
        "diagnostic",
        ""
    );
    let throughput = &rows.throughput;
    println!(
        "| {:<52} | {:>10.0}/s | {:>10.0}/s | {:<14} | {:<6} |",
        "13. Redis pairs, 256 tasks on distinct keys",
        throughput.lockingkit_pairs_per_s,
        throughput.raw_pairs_per_s,
        format!("ratio {:.3}", throughput.ratio()),
        pass(throughput.ratio() >= 1.0)
    );
    println!(
        "| {:<52} | {:>12} | {:>12} | {:<14} | {:<6} |",
        "   connections used (raw: pool of 16)",
        throughput.lockingkit_connections,
        throughput.raw_connections,
        "<= 1/4",
        pass(throughput.lockingkit_connections * 4 <= throughput.raw_connections)
    );
    print_handoff(
        "14. cross-process, Redis, polling only",
        rows.polling,
        "baseline",
        None,
    );
    print_handoff(
        "14. cross-process, Redis, release published",
        rows.published,
        "p50 <= 2 ms",
        Some(rows.published.p50 <= Duration::from_millis(2)),
    );
}

fn redis_json(rows: &RedisRows) -> String {
    format!(
        "\"redis_pairs\":{},\"redis_lockingkit_median_us\":{:.1},\"redis_lockingkit_p99_us\":{:.1},\"redis_raw_median_us\":{:.1},\"redis_raw_p99_us\":{:.1},\"redis_backend_median_us\":{:.1},\"redis_ratio\":{:.3},\
\"redis_throughput_lockingkit_pairs_per_s\":{:.0},\"redis_throughput_raw_pairs_per_s\":{:.0},\"redis_throughput_lockingkit_connections\":{},\"redis_throughput_raw_connections\":{},\
\"redis_handoff_polling_p50_ms\":{:.3},\"redis_handoff_polling_p99_ms\":{:.3},\"redis_handoff_published_p50_ms\":{:.3},\"redis_handoff_published_p99_ms\":{:.3}",
        rows.pairs.pairs,
        rows.pairs.lockingkit.p50.as_secs_f64() * 1e6,
        rows.pairs.lockingkit.p99.as_secs_f64() * 1e6,
        rows.pairs.raw.p50.as_secs_f64() * 1e6,
        rows.pairs.raw.p99.as_secs_f64() * 1e6,
        rows.pairs.backend_only.p50.as_secs_f64() * 1e6,
        rows.pairs.ratio(),
        rows.throughput.lockingkit_pairs_per_s,
        rows.throughput.raw_pairs_per_s,
        rows.throughput.lockingkit_connections,
        rows.throughput.raw_connections,
        ms(rows.polling.p50),
        ms(rows.polling.p99),
        ms(rows.published.p50),
        ms(rows.published.p99),
    )
}

/// One row's hand-off percentiles, against its goal.
fn print_handoff(name: &str, p: Percentiles, goal: &str, ok: Option<bool>) {
    println!(
        "| {name:<52} | {:>9.3} ms | {:>9.3} ms | {goal:<14} | {:<6} |",
        ms(p.p50),
        ms(p.p99),
        ok.map_or("", pass)
    );
}

fn http_memory_json(cost: &LayerCost) -> String {
    format!(
        "\"http_memory_locked_per_s\":{:.0},\"http_memory_plain_per_s\":{:.0},\"http_memory_ratio\":{:.3}",
        cost.locked_per_s,
        cost.plain_per_s,
        cost.ratio()
    )
}

/// Runs the one row `row` names and prints it; false when `row` names none of them.
fn run_one_row(row: &str, sizes: Sizes) -> bool {
    match row {
        "memory" => {
            let (pairs, raw) = bench::in_memory_pairs_per_second(sizes.memory_pairs);
            println!(
                "| 3. in-memory uncontended pairs, one thread | {pairs:.0}/s | raw {raw:.0}/s |"
            );
        }
        "redis" => {
            let rows = redis_rows(sizes);
            print_redis_rows(&rows);
            println!("{{{}}}", redis_json(&rows));
        }
        "transaction" => {
            let report = transaction_locks(&two_worker_runtime(), sizes);
            println!("{}\n", report.render());
            print_transaction_locks(&report);
        }
        "etcd" => print_etcd(sizes),
        "patterns" => patterns_rows(sizes),
        "http-memory" => {
            let cost = http_layer_cost(sizes);
            print_http_layer_cost(&cost);
            println!("{{{}}}", http_memory_json(&cost));
        }
        _ => return false,
    }
    true
}

/// The rows measured without a server, each on a runtime of its own.
struct EngineRows {
    memory_pairs: f64,
    memory_raw_pairs: f64,
    cold_engine: Duration,
    cold_raw: Duration,
    attempts_one: bench::WaitingAttempts,
    attempts_twenty: bench::WaitingAttempts,
    layer_cost: LayerCost,
}

impl EngineRows {
    fn measure(sizes: Sizes) -> EngineRows {
        let (memory_pairs, memory_raw_pairs) =
            bench::in_memory_pairs_per_second(sizes.memory_pairs);
        let (cold_engine, cold_raw) = bench::cold_cache_pairs(sizes.cold_pairs);
        let attempts_one = bench::attempts_while_waiting(1);
        let attempts_twenty = bench::attempts_while_waiting(20);
        let layer_cost = http_layer_cost(sizes);
        EngineRows {
            memory_pairs,
            memory_raw_pairs,
            cold_engine,
            cold_raw,
            attempts_one,
            attempts_twenty,
            layer_cost,
        }
    }

    /// Backend attempts with 20 local waiters over those with one.
    fn twenty_vs_one(&self) -> f64 {
        self.attempts_twenty.attempts as f64 / self.attempts_one.attempts as f64
    }
}

/// The rows measured on the first PostgreSQL server, then on Azurite.
struct ServerRows {
    postgres: bench_postgres::PostgresBenchReport,
    azure: bench_azure::AzureBenchReport,
    memory_local: Percentiles,
    postgres_local: Percentiles,
    remote_polling: Percentiles,
    remote_hint: Percentiles,
    remote_many: Percentiles,
    throughput: bench_sessions::Throughput,
    http: bench_sessions::HttpShape,
}

/// The hand-off rows 5 and 6 on `server`, in the order `ServerRows` lists them.
async fn handoffs(
    server: &PostgresServer,
    sizes: Sizes,
) -> (
    Percentiles,
    Percentiles,
    Percentiles,
    Percentiles,
    Percentiles,
) {
    let memory_local = bench::local_handoff(
        &DistributedLock::in_memory(),
        "handoff/local",
        sizes.local_handoffs,
    )
    .await;
    let postgres_local = bench::local_handoff(
        &postgres_lock(server),
        "handoff/local",
        sizes.local_handoffs,
    )
    .await;

    let holder = postgres_lock(server);
    let remote_polling = bench::cross_process_handoff(
        &holder,
        &polling_postgres_lock(server),
        "handoff/polling",
        sizes.remote_handoffs,
    )
    .await;
    let remote_hint = bench::cross_process_handoff(
        &holder,
        &postgres_lock(server),
        "handoff/hint",
        sizes.remote_handoffs,
    )
    .await;
    let remote_many = bench_sessions::handoff_of_many_keys(
        server,
        &holder,
        &postgres_lock(server),
        "handoff/many",
        16,
        sizes.many_key_rounds,
    )
    .await;
    (
        memory_local,
        postgres_local,
        remote_polling,
        remote_hint,
        remote_many,
    )
}

fn server_rows(runtime: &tokio::runtime::Runtime, sizes: Sizes) -> ServerRows {
    runtime.block_on(async {
        // Measured inside tasks, as application code runs.
        tokio::spawn(async move {
            let server = PostgresServer::start().await;
            let postgres = bench_postgres::measure(&server, sizes.postgres_pairs).await;
            let (memory_local, postgres_local, remote_polling, remote_hint, remote_many) =
                handoffs(&server, sizes).await;
            let throughput =
                bench_sessions::throughput(&server, 256, sizes.load_rounds, sizes.load_round).await;
            let http =
                bench_sessions::http_shape(&server, 32, sizes.load_rounds, sizes.load_round).await;
            drop(server);

            let azurite = Azurite::start().await;
            let azure = bench_azure::measure(&azurite, sizes.azure_pairs).await;
            ServerRows {
                postgres,
                azure,
                memory_local,
                postgres_local,
                remote_polling,
                remote_hint,
                remote_many,
                throughput,
                http,
            }
        })
        .await
        .expect("the benchmark task panicked")
    })
}

/// LockingKit's median over raw SQL doing the same work, fencing included.
fn fenced_ratio(pg: &bench_postgres::PostgresBenchReport) -> f64 {
    ms(pg.lockingkit.median) / ms(pg.raw_fenced.median)
}

fn print_table_header() {
    println!(
        "| {:<52} | {:>12} | {:>12} | {:<14} | {:<6} |",
        "measurement", "lockingkit", "baseline", "goal", "result"
    );
    println!(
        "|{:-<54}|{:-<14}|{:-<14}|{:-<16}|{:-<8}|",
        "", "", "", "", ""
    );
}

/// Rows 1 and 2: a pair on PostgreSQL and on Azure against their raw clients.
fn print_pair_rows(
    pg: &bench_postgres::PostgresBenchReport,
    azure: &bench_azure::AzureBenchReport,
) {
    println!(
        "| {:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<6} |",
        "1. PostgreSQL try_acquire+release vs raw, median",
        ms(pg.lockingkit.median),
        ms(pg.raw_pooled.median),
        format!("ratio {:.3}", pg.ratio()),
        pass(pg.ratio() <= 1.10)
    );
    println!(
        "| {:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<6} |",
        "   same, p99",
        ms(pg.lockingkit.p99),
        ms(pg.raw_pooled.p99),
        format!("ratio {:.3}", ms(pg.lockingkit.p99) / ms(pg.raw_pooled.p99)),
        ""
    );
    let fenced_ratio = fenced_ratio(pg);
    println!(
        "| {:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<6} |",
        "   same vs raw SQL doing the same work (+ fencing)",
        ms(pg.lockingkit.median),
        ms(pg.raw_fenced.median),
        format!("ratio {fenced_ratio:.3}"),
        pass(fenced_ratio <= 1.10)
    );
    println!(
        "| {:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<6} |",
        "2. Azure acquire+release vs raw SDK, median",
        ms(azure.lockingkit),
        ms(azure.raw_same_requests),
        format!("ratio {:.3}", azure.ratio()),
        pass(azure.ratio() <= 1.10)
    );
}

/// Rows 3 and 4: in-memory pairs and the attempts of many local waiters.
fn print_engine_rows(engine: &EngineRows) {
    let twenty_vs_one = engine.twenty_vs_one();
    println!(
        "| {:<52} | {:>10.0}/s | {:>10.0}/s | {:<14} | {:<6} |",
        "3. in-memory uncontended pairs, one thread",
        engine.memory_pairs,
        engine.memory_raw_pairs,
        ">= 500000/s",
        pass(engine.memory_pairs >= 500_000.0)
    );
    println!(
        "| {:<52} | {:>9.1} µs | {:>9.1} µs | {:<14} | {:<6} |",
        "   same, one pair, CPU caches evicted before each call",
        engine.cold_engine.as_secs_f64() * 1e6,
        engine.cold_raw.as_secs_f64() * 1e6,
        "diagnostic",
        ""
    );
    println!(
        "| {:<52} | {:>12} | {:>12} | {:<14} | {:<6} |",
        "4. backend attempts in 60 s, 20 local waiters vs 1",
        engine.attempts_twenty.attempts,
        engine.attempts_one.attempts,
        format!("ratio {twenty_vs_one:.2}"),
        // Retry delays are jittered, so two runs of one waiter differ by a few percent too.
        pass(twenty_vs_one <= ATTEMPTS_JITTER)
    );
    println!(
        "| {:<52} | {:>12} | {:>12} | {:<14} | {:<6} |",
        "   most attempts in flight at once, 20 vs 1 waiter",
        engine.attempts_twenty.most_at_once,
        engine.attempts_one.most_at_once,
        "1 (one stream)",
        pass(engine.attempts_twenty.most_at_once == 1)
    );
}

/// Rows 5 and 6: hand-off from a release to the next holder.
fn print_handoff_rows(rows: &ServerRows) {
    println!(
        "| {:<52} | {:>12} | {:>12} | {:<14} | {:<6} |",
        "5./6. hand-off, release -> next holder", "p50", "p99", "goal", ""
    );
    print_handoff(
        "5. local, in-memory",
        rows.memory_local,
        "p50 < 1 ms",
        Some(rows.memory_local.p50 < Duration::from_millis(1)),
    );
    print_handoff(
        "5. local, PostgreSQL",
        rows.postgres_local,
        "p50 < 1 ms",
        Some(rows.postgres_local.p50 < Duration::from_millis(1)),
    );
    print_handoff(
        "6. cross-process, PostgreSQL, polling only",
        rows.remote_polling,
        "baseline",
        None,
    );
    print_handoff(
        "6. cross-process, PostgreSQL, watcher wakes waiter",
        rows.remote_hint,
        "p50 <= 5 ms",
        Some(rows.remote_hint.p50 <= Duration::from_millis(5)),
    );
    print_handoff(
        "6. same, while 16 keys are waited for at once",
        rows.remote_many,
        "p50 <= 5 ms",
        Some(rows.remote_many.p50 <= Duration::from_millis(5)),
    );
}

/// Rows 7 and 8: PostgreSQL throughput and the HTTP shape under load.
fn print_load_rows(throughput: &bench_sessions::Throughput, http: &bench_sessions::HttpShape) {
    let connections_ok = throughput.lockingkit_connections * 4 <= throughput.raw_connections;
    println!(
        "| {:<52} | {:>10.0}/s | {:>10.0}/s | {:<14} | {:<6} |",
        "7. PostgreSQL pairs, 256 tasks on distinct keys",
        throughput.lockingkit_pairs_per_s,
        throughput.raw_pairs_per_s,
        format!("ratio {:.3}", throughput.ratio()),
        pass(throughput.ratio() >= 1.0)
    );
    println!(
        "| {:<52} | {:>12} | {:>12} | {:<14} | {:<6} |",
        "   connections used (raw: pool of 16)",
        throughput.lockingkit_connections,
        throughput.raw_connections,
        "<= 1/4",
        pass(connections_ok)
    );
    println!(
        "| {:<52} | {:>10.0}/s | {:>10.0}/s | {:<14} | {:<6} |",
        "8. HTTP, lock_route on PostgreSQL vs no layer",
        http.locked_per_s,
        http.plain_per_s,
        format!("ratio {:.3}", http.ratio()),
        pass(http.ratio() >= 0.22)
    );
    println!(
        "| {:<52} | {:>9.1} µs | {:>9.1} µs | {:<14} | {:<6} |",
        "   app CPU per request (server + client)",
        http.locked_app_cpu.as_secs_f64() * 1e6,
        http.plain_app_cpu.as_secs_f64() * 1e6,
        "diagnostic",
        ""
    );
    println!(
        "| {:<52} | {:>9.1} µs | {:>12} | {:<14} | {:<6} |",
        "   PostgreSQL CPU per locked request",
        http.locked_server_cpu.as_secs_f64() * 1e6,
        "-",
        "diagnostic",
        ""
    );
}

/// Row 10: readers and semaphores on PostgreSQL, on a server of their own.
fn modes_rows(runtime: &tokio::runtime::Runtime, sizes: Sizes) -> bench_postgres::ModesReport {
    runtime.block_on(async {
        tokio::spawn(async move {
            let server = PostgresServer::start().await;
            bench_postgres::measure_modes(&server, sizes.postgres_pairs).await
        })
        .await
        .expect("the modes benchmark task panicked")
    })
}

fn print_mode_rows(modes: &bench_postgres::ModesReport) {
    println!(
        "| {:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<6} |",
        "10. PostgreSQL try_read+release vs raw shared, median",
        ms(modes.shared.median),
        ms(modes.raw_shared.median),
        format!("ratio {:.3}", modes.shared_ratio()),
        ""
    );
    println!(
        "| {:<52} | {:>9.3} ms | {:>9.3} ms | {:<14} | {:<6} |",
        format!(
            "   semaphore of {} with {} taken vs raw slot pair",
            modes.slots,
            modes.slots - 1
        ),
        ms(modes.semaphore.median),
        ms(modes.raw_slot.median),
        format!("ratio {:.3}", modes.semaphore_ratio()),
        ""
    );
    println!(
        "| {:<52} | {:>12.2} | {:>12} | {:<14} | {:<6} |",
        "   semaphore try_acquire: round trips per attempt",
        modes.semaphore_round_trips,
        1,
        "1",
        pass(modes.semaphore_round_trips <= 1.0)
    );
}

fn pair_json(
    pg: &bench_postgres::PostgresBenchReport,
    azure: &bench_azure::AzureBenchReport,
) -> String {
    format!(
        "\"postgres_pairs\":{},\"postgres_lockingkit_median_us\":{:.1},\"postgres_lockingkit_p99_us\":{:.1},\"postgres_raw_median_us\":{:.1},\"postgres_raw_p99_us\":{:.1},\"postgres_ratio\":{:.3},\
\"azure_pairs\":{},\"azure_lockingkit_median_ms\":{:.3},\"azure_raw_median_ms\":{:.3},\"azure_ratio\":{:.3}",
        pg.pairs,
        pg.lockingkit.median.as_secs_f64() * 1e6,
        pg.lockingkit.p99.as_secs_f64() * 1e6,
        pg.raw_pooled.median.as_secs_f64() * 1e6,
        pg.raw_pooled.p99.as_secs_f64() * 1e6,
        pg.ratio(),
        azure.pairs,
        ms(azure.lockingkit),
        ms(azure.raw_same_requests),
        azure.ratio(),
    )
}

fn engine_json(engine: &EngineRows) -> String {
    format!(
        "\"in_memory_pairs_per_s\":{:.0},\"in_memory_raw_pairs_per_s\":{:.0},\"cold_cache_pair_us\":{:.2},\"cold_cache_raw_pair_us\":{:.2},\
\"attempts_1_waiter\":{},\"attempts_20_waiters\":{},\"most_attempts_at_once_20_waiters\":{},\"attempts_ratio\":{:.3}",
        engine.memory_pairs,
        engine.memory_raw_pairs,
        engine.cold_engine.as_secs_f64() * 1e6,
        engine.cold_raw.as_secs_f64() * 1e6,
        engine.attempts_one.attempts,
        engine.attempts_twenty.attempts,
        engine.attempts_twenty.most_at_once,
        engine.twenty_vs_one(),
    )
}

/// The local and many-key hand-offs, the fenced ratio and the load rows, in the JSON's order.
fn server_json(rows: &ServerRows) -> String {
    let (throughput, http) = (&rows.throughput, &rows.http);
    format!(
        "\"local_handoff_memory_p50_ms\":{:.4},\"local_handoff_memory_p99_ms\":{:.4},\"local_handoff_postgres_p50_ms\":{:.4},\"local_handoff_postgres_p99_ms\":{:.4},\
\"remote_handoff_16_keys_p50_ms\":{:.3},\"remote_handoff_16_keys_p99_ms\":{:.3},\"postgres_fenced_ratio\":{:.3},\
\"throughput_lockingkit_pairs_per_s\":{:.0},\"throughput_raw_pairs_per_s\":{:.0},\"throughput_lockingkit_connections\":{},\"throughput_raw_connections\":{},\
\"http_locked_per_s\":{:.0},\"http_plain_per_s\":{:.0},\"http_ratio\":{:.3},\"http_locked_app_cpu_us\":{:.1},\"http_plain_app_cpu_us\":{:.1},\"http_locked_server_cpu_us\":{:.1}",
        ms(rows.memory_local.p50),
        ms(rows.memory_local.p99),
        ms(rows.postgres_local.p50),
        ms(rows.postgres_local.p99),
        ms(rows.remote_many.p50),
        ms(rows.remote_many.p99),
        fenced_ratio(&rows.postgres),
        throughput.lockingkit_pairs_per_s,
        throughput.raw_pairs_per_s,
        throughput.lockingkit_connections,
        throughput.raw_connections,
        http.locked_per_s,
        http.plain_per_s,
        http.ratio(),
        http.locked_app_cpu.as_secs_f64() * 1e6,
        http.plain_app_cpu.as_secs_f64() * 1e6,
        http.locked_server_cpu.as_secs_f64() * 1e6,
    )
}

fn transaction_json(report: &TransactionBenchReport) -> String {
    format!(
        "\"transaction_unnamed_median_us\":{:.1},\"transaction_raw_unnamed_median_us\":{:.1},\"transaction_unnamed_ratio\":{:.3},\"transaction_prepared_median_us\":{:.1},\"transaction_raw_prepared_median_us\":{:.1},\"transaction_prepared_ratio\":{:.3}",
        report.lockingkit_unnamed.median.as_secs_f64() * 1e6,
        report.raw_unnamed.median.as_secs_f64() * 1e6,
        report.unnamed_ratio(),
        report.lockingkit_prepared.median.as_secs_f64() * 1e6,
        report.raw_prepared.median.as_secs_f64() * 1e6,
        report.prepared_ratio(),
    )
}

fn remote_handoff_json(rows: &ServerRows, sizes: Sizes) -> String {
    format!(
        "\"remote_handoff_polling_p50_ms\":{:.3},\"remote_handoff_polling_p99_ms\":{:.3},\"remote_handoff_hint_p50_ms\":{:.3},\"remote_handoff_hint_p99_ms\":{:.3},\"remote_handoffs\":{}",
        ms(rows.remote_polling.p50),
        ms(rows.remote_polling.p99),
        ms(rows.remote_hint.p50),
        ms(rows.remote_hint.p99),
        sizes.remote_handoffs,
    )
}

/// The full run's JSON line (the etcd rows print their own).
fn full_json(
    engine: &EngineRows,
    servers: &ServerRows,
    transactions: &TransactionBenchReport,
    redis: &RedisRows,
    sizes: Sizes,
) -> String {
    format!(
        "{{{},{},{},{},{},{},{}}}",
        pair_json(&servers.postgres, &servers.azure),
        engine_json(engine),
        server_json(servers),
        http_memory_json(&engine.layer_cost),
        transaction_json(transactions),
        remote_handoff_json(servers, sizes),
        redis_json(redis),
    )
}

/// The reports, the table's header and rows 1 to 8.
fn print_server_table(engine: &EngineRows, servers: &ServerRows) {
    println!("{}\n", servers.postgres.render());
    println!("{}\n", servers.azure.render());
    print_table_header();
    print_pair_rows(&servers.postgres, &servers.azure);
    print_engine_rows(engine);
    print_handoff_rows(servers);
    print_load_rows(&servers.throughput, &servers.http);
}

/// Every row, measured and printed in the table's order, then the JSON line, then the etcd
/// and the patterns' rows.
fn full_run(sizes: Sizes) {
    // Engine-only measurements first, each on a runtime of its own, before any server runs.
    let engine = EngineRows::measure(sizes);
    let runtime = two_worker_runtime();
    let servers = server_rows(&runtime, sizes);
    print_server_table(&engine, &servers);
    // Readers and semaphores on PostgreSQL, on a server of their own after the rows above.
    let modes = modes_rows(&runtime, sizes);
    print_mode_rows(&modes);
    let transactions = transaction_locks(&runtime, sizes);
    print_transaction_locks(&transactions);
    print_http_layer_cost(&engine.layer_cost);
    // Redis on a server of its own, after the rows above.
    let redis = redis_rows(sizes);
    print_redis_rows(&redis);
    println!();
    println!("{}", transactions.render());
    println!(
        "{}",
        full_json(&engine, &servers, &transactions, &redis, sizes)
    );
    print_etcd(sizes);
    patterns_rows(sizes);
}

fn main() {
    let Some(mode) = BenchMode::from_args() else {
        return;
    };
    let sizes = mode.pick(FULL, SMOKE);
    // The first argument that is not a flag names the one row to run, if any.
    let only = std::env::args().skip(1).find(|arg| !arg.starts_with('-'));
    if only.is_some_and(|row| run_one_row(&row, sizes)) {
        return;
    }
    full_run(sizes);
}
