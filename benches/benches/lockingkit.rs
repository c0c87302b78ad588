//! LockingKit's performance goals, each measured next to its baseline in one run: starts a
//! throwaway PostgreSQL server, Azurite and Redis servers itself and prints a table, then one
//! JSON line.
//!
//! ```text
//! scripts/setup-postgres.sh && scripts/setup-azurite.sh && scripts/setup-redis.sh
//! cargo bench -p lockingkit-benches --bench lockingkit
//! ```
//!
//! Without `--bench` (`cargo test --all-targets`) every measurement runs a few samples as a
//! smoke test; it lists no tests to nextest.
//!
//! `cargo bench -p lockingkit-benches --bench lockingkit -- memory` runs only row 3
//! (in-memory pairs), `… -- http-memory` only the row of the HTTP layer's own cost (in-memory
//! lock, no servers to start), `… -- transaction` only row 11 (transaction-scoped try-lock, on
//! a PostgreSQL server of its own), `-- redis` only the Redis rows 12–14 (it starts a Redis
//! server; `scripts/setup-redis.sh` installs it), `-- etcd` only the etcd rows (it starts its
//! own one- and three-member clusters; `scripts/setup-etcd.sh`), `-- mysql` only the MySQL rows
//! 15–17 (it starts a MariaDB server; `scripts/setup-mariadb.sh`) and `-- patterns` only the
//! patterns' rows; the full run prints the etcd, the MySQL and the patterns' rows after the
//! table.

use std::time::Duration;

use lockingkit::{DistributedLock, MemoryStore};
use lockingkit_benches::azure_rows::{self, AzureBenchReport};
use lockingkit_benches::engine::{self, WaitingAttempts};
use lockingkit_benches::handoff::{
    cross_process_handoff, handoff_of_many_keys, local_handoff, polling_lock,
};
use lockingkit_benches::http_load::{http_shape, in_memory_layer_cost, HttpShape, RouteRates};
use lockingkit_benches::load::Throughput;
use lockingkit_benches::mode::{in_task, two_worker_runtime, BenchMode};
use lockingkit_benches::mysql_rows::{self, MysqlReport};
use lockingkit_benches::pair::lock_on;
use lockingkit_benches::postgres_modes::{measure_modes, ModesReport};
use lockingkit_benches::postgres_pairs::{self, backend, PostgresBenchReport};
use lockingkit_benches::postgres_throughput::throughput;
use lockingkit_benches::redis_rows::{self, RedisPairs};
use lockingkit_benches::samples::Percentiles;
use lockingkit_benches::table::{in_micros, in_ms, micros, ms, pass, per_second, ratio, row};
use lockingkit_benches::transaction_locks::{measure_transaction, TransactionBenchReport};
use lockingkit_benches::{etcd_rows, patterns};
use lockingkit_tests::azurite::Azurite;
use lockingkit_tests::postgres::PostgresServer;
use lockingkit_tests::redis::RedisServer;
use tokio::runtime::Runtime;

/// Counts allocations during the HTTP rows' rounds, for their allocations per request (a
/// relaxed increment per allocation then, paid alike by both sides; a relaxed load otherwise).
#[global_allocator]
static ALLOCATOR: lockingkit_benches::allocations::Counting =
    lockingkit_benches::allocations::Counting;

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
    /// Pairs of each MySQL variant, and MySQL cross-process hand-offs (short holds).
    mysql_pairs: usize,
    mysql_handoffs: usize,
    /// Whether the MySQL rows run client and server on CPUs of their own (see
    /// `lockingkit_benches::cpus`): only when measuring for real.
    split_cpus: bool,
    /// Rounds of each side, and each round's length, for throughput.
    load_rounds: usize,
    load_round: Duration,
    /// Rounds of each side, and each round's length, for the HTTP rows: more and shorter, as
    /// their ratio is the median of the rounds'.
    http_rounds: usize,
    http_round: Duration,
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
    mysql_pairs: 2000,
    mysql_handoffs: 300,
    split_cpus: true,
    load_rounds: 3,
    load_round: Duration::from_secs(2),
    http_rounds: 11,
    http_round: Duration::from_millis(600),
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
    mysql_pairs: 5,
    mysql_handoffs: 3,
    split_cpus: false,
    load_rounds: 1,
    load_round: Duration::from_millis(100),
    http_rounds: 1,
    http_round: Duration::from_millis(100),
};

/// How far the attempts with 20 waiters may exceed those with one: retry delays are jittered,
/// so two runs with one waiter differ by a few percent as well.
const ATTEMPTS_JITTER: f64 = 1.05;

/// Keep-alive connections of the HTTP rows.
const HTTP_CONNECTIONS: usize = 32;

/// Tasks of the throughput rows, each on keys of its own.
const LOAD_TASKS: usize = 256;

/// A lock on `server` as the rows use it, renewal checks every 30 s.
fn postgres_lock(server: &PostgresServer) -> DistributedLock {
    lock_on(backend(server.options(Duration::from_secs(30))))
}

/// The patterns' rows: a multi-key hold of two keys vs two single holds in sequence on
/// PostgreSQL, and election failover (leader resigns → another provider's campaign leads) on
/// PostgreSQL and in memory, p50 over repeated runs.
fn patterns_rows(sizes: Sizes) {
    in_task(&two_worker_runtime(), "the patterns' rows", async move {
        let server = PostgresServer::start().await;
        let locks = postgres_lock(&server);
        let pairs = sizes.postgres_pairs / 5;
        let (multi, singles) = patterns::multi_key_pair(&locks, pairs).await;
        println!(
            "| multi-key pair (2 keys), PostgreSQL | p50 {:.3} ms | two single pairs in sequence p50 {:.3} ms |",
            ms(multi.p50),
            ms(singles.p50)
        );
        let follower = postgres_lock(&server);
        let runs = sizes.remote_handoffs;
        let pg = patterns::failover(|| postgres_lock(&server), &follower, runs).await;
        let store = MemoryStore::new();
        let memory_follower = DistributedLock::in_memory_shared(&store);
        let in_memory = || DistributedLock::in_memory_shared(&store);
        let memory = patterns::failover(in_memory, &memory_follower, runs).await;
        println!(
            "| election failover (resign → other leads) | PostgreSQL p50 {:.1} ms | in-memory p50 {:.1} ms |",
            ms(pg.p50),
            ms(memory.p50)
        );
    });
}

/// The row of the HTTP layer's own cost: a no-op route with and without `lock_route` on the
/// in-memory lock, interleaved in one run.
fn http_layer_cost(sizes: Sizes) -> RouteRates {
    let cost = in_memory_layer_cost(HTTP_CONNECTIONS, sizes.http_rounds, sizes.http_round);
    in_task(&two_worker_runtime(), "the HTTP layer benchmark", cost)
}

/// An HTTP row: the locked route's requests per second against the plain one's, with the
/// least ratio that meets the goal.
fn print_route_rates(name: &str, rates: &RouteRates, at_least: f64) {
    let (locked, plain) = (
        per_second(rates.locked_per_s),
        per_second(rates.plain_per_s),
    );
    let measured = rates.ratio();
    row(
        name,
        locked,
        plain,
        &ratio(measured),
        pass(measured >= at_least),
    );
}

fn print_http_layer_cost(cost: &RouteRates) {
    print_route_rates(
        "9. HTTP, lock_route in-memory vs no layer, no-op",
        cost,
        0.90,
    );
    print_request_costs(cost);
}

/// The diagnostic rows under an HTTP row: CPU and allocations per request, each side.
fn print_request_costs(rates: &RouteRates) {
    row(
        "   app CPU per request (server + client)",
        in_micros(rates.locked_cpu),
        in_micros(rates.plain_cpu),
        "diagnostic",
        "",
    );
    row(
        "   allocations per request (server + client)",
        format!("{:.1}", rates.locked_allocations),
        format!("{:.1}", rates.plain_allocations),
        "diagnostic",
        "",
    );
}

/// Row 11: the transaction-scoped try-lock against the raw statement, on a server of its own.
fn transaction_locks(runtime: &Runtime, sizes: Sizes) -> TransactionBenchReport {
    in_task(runtime, "the transaction benchmark", async move {
        let server = PostgresServer::start().await;
        measure_transaction(&server, sizes.postgres_pairs).await
    })
}

fn print_transaction_locks(report: &TransactionBenchReport) {
    // The result column is as wide as "diagnostic", which it reads on the last two rows.
    let transaction_row = |name: &str, ours: Percentiles, baseline: Percentiles, goal: bool| {
        let measured = ours.ratio_to(baseline);
        let result = if goal {
            pass(measured <= 1.10)
        } else {
            "diagnostic"
        };
        let (ours, baseline) = (in_ms(ours.p50), in_ms(baseline.p50));
        row(
            name,
            ours,
            baseline,
            &ratio(measured),
            &format!("{result:<10}"),
        );
    };
    transaction_row(
        "11. PostgreSQL transaction try-lock, unnamed vs raw",
        report.lockingkit_unnamed,
        report.raw_unnamed,
        true,
    );
    transaction_row(
        "11. same, deadpool (prepared) vs raw prepare_cached",
        report.lockingkit_prepared,
        report.raw_prepared,
        true,
    );
    transaction_row(
        "   unnamed vs its own statement sent by hand",
        report.lockingkit_unnamed,
        report.same_unnamed,
        false,
    );
    transaction_row(
        "   prepared vs its own statement prepared by hand",
        report.lockingkit_prepared,
        report.same_prepared,
        false,
    );
}

/// The etcd rows, on clusters of their own (`scripts/setup-etcd.sh`).
fn print_etcd(sizes: Sizes) {
    let etcd_sizes = etcd_rows::EtcdSizes {
        pairs: sizes.postgres_pairs / 5,
        handoffs: sizes.remote_handoffs,
        load: sizes.load_round,
    };
    let report = in_task(
        &two_worker_runtime(),
        "the etcd rows",
        etcd_rows::measure(etcd_sizes),
    );
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

/// The MySQL rows 15–17, on a MariaDB server of their own (`scripts/setup-mariadb.sh`), with
/// the table's header (they print after the etcd rows), then their JSON line. The throughput
/// row's rounds are half as long as row 7's.
fn print_mysql(sizes: Sizes) {
    let mysql_sizes = mysql_rows::MysqlSizes {
        pairs: sizes.mysql_pairs,
        handoffs: sizes.mysql_handoffs,
        load_rounds: sizes.load_rounds,
        load_round: sizes.load_round / 2,
        // `LOCKINGKIT_BENCH_ANY_CPU=1` lets client and server run anywhere, as before.
        split_cpus: sizes.split_cpus && std::env::var_os("LOCKINGKIT_BENCH_ANY_CPU").is_none(),
    };
    let report = in_task(
        &two_worker_runtime(),
        "the MySQL rows",
        mysql_rows::measure(mysql_sizes),
    );
    println!("MySQL rows: {}", report.cpus);
    print_table_header();
    print_mysql_rows(&report);
    println!("{{{}}}", mysql_json(&report));
}

/// The diagnostic row under a pair row: `backend` alone, without the engine, against the
/// same raw baseline.
fn print_backend_alone(backend: &str, alone: Percentiles, raw: Percentiles) {
    row(
        &format!("   {backend} alone (no engine) vs raw, median"),
        in_ms(alone.p50),
        in_ms(raw.p50),
        "diagnostic",
        "",
    );
}

fn print_mysql_rows(report: &MysqlReport) {
    let pairs = &report.pairs;
    let name = "15. MySQL try_acquire+release vs same SQL raw";
    print_pair(name, pairs.lockingkit, pairs.raw);
    print_backend_alone("MysqlBackend", pairs.backend_only, pairs.raw);
    let throughput = &report.throughput;
    let measured = throughput.ratio();
    row(
        "16. MySQL pairs, 256 tasks on distinct keys",
        per_second(throughput.lockingkit_pairs_per_s),
        per_second(throughput.raw_pairs_per_s),
        &ratio(measured),
        // The issue sets no goal for it.
        "no goal",
    );
    row(
        "   connections used (raw: pool of 16)",
        throughput.lockingkit_connections,
        throughput.raw_connections,
        "diagnostic",
        "",
    );
    row(
        "17. hand-off, release -> next holder",
        "p50",
        "p99",
        "goal",
        "",
    );
    print_handoff(
        "17. cross-process, MySQL, waiting GET_LOCK granted",
        report.handoff,
        "p50 <= 5 ms",
        Some(report.handoff.p50 <= Duration::from_millis(5)),
    );
}

fn mysql_json(report: &MysqlReport) -> String {
    let (pairs, throughput) = (&report.pairs, &report.throughput);
    format!(
        "\"mysql_pairs\":{},\"mysql_lockingkit_median_us\":{:.1},\"mysql_lockingkit_p99_us\":{:.1},\"mysql_raw_median_us\":{:.1},\"mysql_raw_p99_us\":{:.1},\"mysql_backend_median_us\":{:.1},\"mysql_ratio\":{:.3},\
\"mysql_throughput_lockingkit_pairs_per_s\":{:.0},\"mysql_throughput_raw_pairs_per_s\":{:.0},\"mysql_throughput_ratio\":{:.3},\"mysql_throughput_lockingkit_connections\":{},\"mysql_throughput_raw_connections\":{},\
\"mysql_handoff_p50_ms\":{:.3},\"mysql_handoff_p99_ms\":{:.3},\"mysql_handoffs\":{}",
        pairs.pairs,
        micros(pairs.lockingkit.p50),
        micros(pairs.lockingkit.p99),
        micros(pairs.raw.p50),
        micros(pairs.raw.p99),
        micros(pairs.backend_only.p50),
        pairs.ratio(),
        throughput.lockingkit_pairs_per_s,
        throughput.raw_pairs_per_s,
        throughput.ratio(),
        throughput.lockingkit_connections,
        throughput.raw_connections,
        ms(report.handoff.p50),
        ms(report.handoff.p99),
        report.handoffs,
    )
}

/// The Redis rows, on a server of their own.
struct RedisRows {
    pairs: RedisPairs,
    throughput: Throughput,
    polling: Percentiles,
    published: Percentiles,
}

fn redis_rows(sizes: Sizes) -> RedisRows {
    in_task(&two_worker_runtime(), "the Redis benchmark", async move {
        let server = RedisServer::start().await;
        let pairs = redis_rows::measure(&server, sizes.redis_pairs).await;
        // A server of its own, whose clients are only the two sides being counted.
        let fresh = RedisServer::start().await;
        let (rounds, length) = (sizes.load_rounds, sizes.load_round);
        let throughput = redis_rows::throughput(&fresh, LOAD_TASKS, rounds, length).await;
        drop(fresh);
        let holder = redis_rows::lock(&server);
        let samples = sizes.remote_handoffs;
        // Each waiting side is a lock of its own, dropped once measured.
        let waiter = || redis_rows::polling_lock(&server);
        let polling =
            cross_process_handoff(&holder, &waiter(), "handoff/redis/polling", samples).await;
        let waiter = || redis_rows::lock(&server);
        let published =
            cross_process_handoff(&holder, &waiter(), "handoff/redis/published", samples).await;
        RedisRows {
            pairs,
            throughput,
            polling,
            published,
        }
    })
}

/// A pair row against its raw baseline (goal: a median ratio of at most 1.10), and its p99.
fn print_pair(name: &str, ours: Percentiles, baseline: Percentiles) {
    let measured = ours.ratio_to(baseline);
    row(
        name,
        in_ms(ours.p50),
        in_ms(baseline.p50),
        &ratio(measured),
        pass(measured <= 1.10),
    );
    let p99_ratio = ms(ours.p99) / ms(baseline.p99);
    row(
        "   same, p99",
        in_ms(ours.p99),
        in_ms(baseline.p99),
        &ratio(p99_ratio),
        "",
    );
}

/// A throughput row (goal: at least the baseline's pairs per second) and the connections each
/// side used (goal: at most a quarter of the baseline's pool).
fn print_throughput(name: &str, throughput: &Throughput) {
    let (ours, raw) = (
        throughput.lockingkit_pairs_per_s,
        throughput.raw_pairs_per_s,
    );
    let measured = throughput.ratio();
    row(
        name,
        per_second(ours),
        per_second(raw),
        &ratio(measured),
        pass(measured >= 1.0),
    );
    let (ours, raw) = (
        throughput.lockingkit_connections,
        throughput.raw_connections,
    );
    row(
        "   connections used (raw: pool of 16)",
        ours,
        raw,
        "<= 1/4",
        pass(ours * 4 <= raw),
    );
}

fn print_redis_rows(rows: &RedisRows) {
    let pairs = &rows.pairs;
    let name = "12. Redis try_acquire+release vs same scripts raw";
    print_pair(name, pairs.lockingkit, pairs.raw);
    print_backend_alone("RedisBackend", pairs.backend_only, pairs.raw);
    print_throughput(
        "13. Redis pairs, 256 tasks on distinct keys",
        &rows.throughput,
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
        micros(rows.pairs.lockingkit.p50),
        micros(rows.pairs.lockingkit.p99),
        micros(rows.pairs.raw.p50),
        micros(rows.pairs.raw.p99),
        micros(rows.pairs.backend_only.p50),
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
    row(name, in_ms(p.p50), in_ms(p.p99), goal, ok.map_or("", pass));
}

fn http_memory_json(cost: &RouteRates) -> String {
    format!(
        "\"http_memory_locked_per_s\":{:.0},\"http_memory_plain_per_s\":{:.0},\"http_memory_ratio\":{:.3},\"http_memory_locked_cpu_us\":{:.2},\"http_memory_plain_cpu_us\":{:.2},\"http_memory_locked_allocations\":{:.1},\"http_memory_plain_allocations\":{:.1}",
        cost.locked_per_s,
        cost.plain_per_s,
        cost.ratio(),
        micros(cost.locked_cpu),
        micros(cost.plain_cpu),
        cost.locked_allocations,
        cost.plain_allocations
    )
}

/// Runs the one row `row` names and prints it; false when `row` names none of them.
fn run_one_row(row: &str, sizes: Sizes) -> bool {
    match row {
        "memory" => {
            let (pairs, raw) = engine::in_memory_pairs_per_second(sizes.memory_pairs);
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
        "mysql" => print_mysql(sizes),
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
    attempts_one: WaitingAttempts,
    attempts_twenty: WaitingAttempts,
    layer_cost: RouteRates,
}

impl EngineRows {
    fn measure(sizes: Sizes) -> EngineRows {
        let (memory_pairs, memory_raw_pairs) =
            engine::in_memory_pairs_per_second(sizes.memory_pairs);
        let (cold_engine, cold_raw) = engine::cold_cache_pairs(sizes.cold_pairs);
        let attempts_one = engine::attempts_while_waiting(1);
        let attempts_twenty = engine::attempts_while_waiting(20);
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

/// The hand-offs of rows 5 and 6.
struct Handoffs {
    memory_local: Percentiles,
    postgres_local: Percentiles,
    remote_polling: Percentiles,
    remote_hint: Percentiles,
    remote_many: Percentiles,
}

impl Handoffs {
    /// Rows 5 and 6 on `server`.
    async fn measure(server: &PostgresServer, sizes: Sizes) -> Handoffs {
        // Each waiting side is a lock of its own, dropped (its sessions closed) once measured.
        let (key, samples) = ("handoff/local", sizes.local_handoffs);
        let memory_local = local_handoff(&DistributedLock::in_memory(), key, samples).await;
        let postgres_local = local_handoff(&postgres_lock(server), key, samples).await;

        let holder = postgres_lock(server);
        let samples = sizes.remote_handoffs;
        let polling = || polling_lock(backend(server.options(Duration::from_secs(30))));
        let remote_polling =
            cross_process_handoff(&holder, &polling(), "handoff/polling", samples).await;
        let remote_hint =
            cross_process_handoff(&holder, &postgres_lock(server), "handoff/hint", samples).await;
        let (prefix, rounds) = ("handoff/many", sizes.many_key_rounds);
        let waiter = postgres_lock(server);
        let remote_many = handoff_of_many_keys(server, &holder, &waiter, prefix, 16, rounds).await;
        Handoffs {
            memory_local,
            postgres_local,
            remote_polling,
            remote_hint,
            remote_many,
        }
    }
}

/// The rows measured on the first PostgreSQL server, then on Azurite.
struct ServerRows {
    postgres: PostgresBenchReport,
    azure: AzureBenchReport,
    handoffs: Handoffs,
    throughput: Throughput,
    http: HttpShape,
}

fn server_rows(runtime: &Runtime, sizes: Sizes) -> ServerRows {
    in_task(runtime, "the benchmark", async move {
        let server = PostgresServer::start().await;
        let postgres = postgres_pairs::measure(&server, sizes.postgres_pairs).await;
        let handoffs = Handoffs::measure(&server, sizes).await;
        let (rounds, length) = (sizes.load_rounds, sizes.load_round);
        let throughput = throughput(&server, LOAD_TASKS, rounds, length).await;
        let http = http_shape(
            &server,
            HTTP_CONNECTIONS,
            sizes.http_rounds,
            sizes.http_round,
        )
        .await;
        drop(server);

        let azurite = Azurite::start().await;
        let azure = azure_rows::measure(&azurite, sizes.azure_pairs).await;
        ServerRows {
            postgres,
            azure,
            handoffs,
            throughput,
            http,
        }
    })
}

fn print_table_header() {
    row("measurement", "lockingkit", "baseline", "goal", "result");
    println!(
        "|{:-<54}|{:-<14}|{:-<14}|{:-<16}|{:-<8}|",
        "", "", "", "", ""
    );
}

/// Rows 1 and 2: a pair on PostgreSQL and on Azure against their raw clients.
fn print_pair_rows(pg: &PostgresBenchReport, azure: &AzureBenchReport) {
    let name = "1. PostgreSQL try_acquire+release vs raw, median";
    print_pair(name, pg.lockingkit, pg.raw_pooled);
    let fenced_ratio = pg.fenced_ratio();
    row(
        "   same vs raw SQL doing the same work (+ fencing)",
        in_ms(pg.lockingkit.p50),
        in_ms(pg.raw_fenced.p50),
        &ratio(fenced_ratio),
        pass(fenced_ratio <= 1.10),
    );
    row(
        "2. Azure acquire+release vs raw SDK, median",
        in_ms(azure.lockingkit),
        in_ms(azure.raw_same_requests),
        &ratio(azure.ratio()),
        pass(azure.ratio() <= 1.10),
    );
}

/// Rows 3 and 4: in-memory pairs and the attempts of many local waiters.
fn print_engine_rows(engine: &EngineRows) {
    let twenty_vs_one = engine.twenty_vs_one();
    row(
        "3. in-memory uncontended pairs, one thread",
        per_second(engine.memory_pairs),
        per_second(engine.memory_raw_pairs),
        ">= 500000/s",
        pass(engine.memory_pairs >= 500_000.0),
    );
    row(
        "   same, one pair, CPU caches evicted before each call",
        in_micros(engine.cold_engine),
        in_micros(engine.cold_raw),
        "diagnostic",
        "",
    );
    let (twenty, one) = (engine.attempts_twenty, engine.attempts_one);
    row(
        "4. backend attempts in 60 s, 20 local waiters vs 1",
        twenty.attempts,
        one.attempts,
        &format!("ratio {twenty_vs_one:.2}"),
        // Retry delays are jittered, so two runs of one waiter differ by a few percent too.
        pass(twenty_vs_one <= ATTEMPTS_JITTER),
    );
    row(
        "   most attempts in flight at once, 20 vs 1 waiter",
        twenty.most_at_once,
        one.most_at_once,
        "1 (one stream)",
        pass(twenty.most_at_once == 1),
    );
}

/// Rows 5 and 6: hand-off from a release to the next holder.
fn print_handoff_rows(handoffs: &Handoffs) {
    let (one_ms, five_ms) = (Duration::from_millis(1), Duration::from_millis(5));
    row(
        "5./6. hand-off, release -> next holder",
        "p50",
        "p99",
        "goal",
        "",
    );
    print_handoff(
        "5. local, in-memory",
        handoffs.memory_local,
        "p50 < 1 ms",
        Some(handoffs.memory_local.p50 < one_ms),
    );
    print_handoff(
        "5. local, PostgreSQL",
        handoffs.postgres_local,
        "p50 < 1 ms",
        Some(handoffs.postgres_local.p50 < one_ms),
    );
    print_handoff(
        "6. cross-process, PostgreSQL, polling only",
        handoffs.remote_polling,
        "baseline",
        None,
    );
    print_handoff(
        "6. cross-process, PostgreSQL, watcher wakes waiter",
        handoffs.remote_hint,
        "p50 <= 5 ms",
        Some(handoffs.remote_hint.p50 <= five_ms),
    );
    print_handoff(
        "6. same, while 16 keys are waited for at once",
        handoffs.remote_many,
        "p50 <= 5 ms",
        Some(handoffs.remote_many.p50 <= five_ms),
    );
}

/// Rows 7 and 8: PostgreSQL throughput and the HTTP shape under load.
fn print_load_rows(throughput: &Throughput, http: &HttpShape) {
    print_throughput(
        "7. PostgreSQL pairs, 256 tasks on distinct keys",
        throughput,
    );
    print_route_rates(
        "8. HTTP, lock_route on PostgreSQL vs no layer",
        &http.rates,
        0.33,
    );
    print_request_costs(&http.rates);
    row(
        "   PostgreSQL CPU per locked request",
        in_micros(http.locked_server_cpu),
        "-",
        "diagnostic",
        "",
    );
}

/// Row 10: readers and semaphores on PostgreSQL, on a server of their own.
fn modes_rows(runtime: &Runtime, sizes: Sizes) -> ModesReport {
    in_task(runtime, "the modes benchmark", async move {
        let server = PostgresServer::start().await;
        measure_modes(&server, sizes.postgres_pairs).await
    })
}

fn print_mode_rows(modes: &ModesReport) {
    row(
        "10. PostgreSQL try_read+release vs raw shared, median",
        in_ms(modes.shared.p50),
        in_ms(modes.raw_shared.p50),
        &ratio(modes.shared_ratio()),
        "",
    );
    row(
        &format!(
            "   semaphore of {} with {} taken vs raw slot pair",
            modes.slots,
            modes.slots - 1
        ),
        in_ms(modes.semaphore.p50),
        in_ms(modes.raw_slot.p50),
        &ratio(modes.semaphore_ratio()),
        "",
    );
    row(
        "   semaphore try_acquire: round trips per attempt",
        format!("{:.2}", modes.semaphore_round_trips),
        1,
        "1",
        pass(modes.semaphore_round_trips <= 1.0),
    );
}

fn pair_json(pg: &PostgresBenchReport, azure: &AzureBenchReport) -> String {
    format!(
        "\"postgres_pairs\":{},\"postgres_lockingkit_median_us\":{:.1},\"postgres_lockingkit_p99_us\":{:.1},\"postgres_raw_median_us\":{:.1},\"postgres_raw_p99_us\":{:.1},\"postgres_ratio\":{:.3},\
\"azure_pairs\":{},\"azure_lockingkit_median_ms\":{:.3},\"azure_raw_median_ms\":{:.3},\"azure_ratio\":{:.3}",
        pg.pairs,
        micros(pg.lockingkit.p50),
        micros(pg.lockingkit.p99),
        micros(pg.raw_pooled.p50),
        micros(pg.raw_pooled.p99),
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
        micros(engine.cold_engine),
        micros(engine.cold_raw),
        engine.attempts_one.attempts,
        engine.attempts_twenty.attempts,
        engine.attempts_twenty.most_at_once,
        engine.twenty_vs_one(),
    )
}

/// The local and many-key hand-offs, the fenced ratio and the load rows, in the JSON's order.
fn server_json(rows: &ServerRows) -> String {
    let (handoffs, throughput, http) = (&rows.handoffs, &rows.throughput, &rows.http);
    format!(
        "\"local_handoff_memory_p50_ms\":{:.4},\"local_handoff_memory_p99_ms\":{:.4},\"local_handoff_postgres_p50_ms\":{:.4},\"local_handoff_postgres_p99_ms\":{:.4},\
\"remote_handoff_16_keys_p50_ms\":{:.3},\"remote_handoff_16_keys_p99_ms\":{:.3},\"postgres_fenced_ratio\":{:.3},\
\"throughput_lockingkit_pairs_per_s\":{:.0},\"throughput_raw_pairs_per_s\":{:.0},\"throughput_lockingkit_connections\":{},\"throughput_raw_connections\":{},\
\"http_locked_per_s\":{:.0},\"http_plain_per_s\":{:.0},\"http_ratio\":{:.3},\"http_locked_app_cpu_us\":{:.1},\"http_plain_app_cpu_us\":{:.1},\"http_locked_server_cpu_us\":{:.1}",
        ms(handoffs.memory_local.p50),
        ms(handoffs.memory_local.p99),
        ms(handoffs.postgres_local.p50),
        ms(handoffs.postgres_local.p99),
        ms(handoffs.remote_many.p50),
        ms(handoffs.remote_many.p99),
        rows.postgres.fenced_ratio(),
        throughput.lockingkit_pairs_per_s,
        throughput.raw_pairs_per_s,
        throughput.lockingkit_connections,
        throughput.raw_connections,
        http.rates.locked_per_s,
        http.rates.plain_per_s,
        http.rates.ratio(),
        micros(http.rates.locked_cpu),
        micros(http.rates.plain_cpu),
        micros(http.locked_server_cpu),
    )
}

fn transaction_json(report: &TransactionBenchReport) -> String {
    format!(
        "\"transaction_unnamed_median_us\":{:.1},\"transaction_raw_unnamed_median_us\":{:.1},\"transaction_unnamed_ratio\":{:.3},\"transaction_prepared_median_us\":{:.1},\"transaction_raw_prepared_median_us\":{:.1},\"transaction_prepared_ratio\":{:.3}",
        micros(report.lockingkit_unnamed.p50),
        micros(report.raw_unnamed.p50),
        report.unnamed_ratio(),
        micros(report.lockingkit_prepared.p50),
        micros(report.raw_prepared.p50),
        report.prepared_ratio(),
    )
}

fn remote_handoff_json(handoffs: &Handoffs, sizes: Sizes) -> String {
    format!(
        "\"remote_handoff_polling_p50_ms\":{:.3},\"remote_handoff_polling_p99_ms\":{:.3},\"remote_handoff_hint_p50_ms\":{:.3},\"remote_handoff_hint_p99_ms\":{:.3},\"remote_handoffs\":{}",
        ms(handoffs.remote_polling.p50),
        ms(handoffs.remote_polling.p99),
        ms(handoffs.remote_hint.p50),
        ms(handoffs.remote_hint.p99),
        sizes.remote_handoffs,
    )
}

/// The full run's JSON line (the etcd and the MySQL rows print their own).
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
        remote_handoff_json(&servers.handoffs, sizes),
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
    print_handoff_rows(&servers.handoffs);
    print_load_rows(&servers.throughput, &servers.http);
}

/// Every row, measured and printed in the table's order, then the JSON line, then the etcd,
/// the MySQL and the patterns' rows.
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
    print_mysql(sizes);
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
