//! The short form of the benchmark table, for CI: every row that has a raw baseline, measured
//! next to it in one run with a few hundred samples, and compared with the ratio recorded for
//! that row in `benches/smoke-reference.txt`. A row fails when its ratio to its own baseline is
//! more than 25% worse than recorded: a latency ratio above 1.25 times its record, a rate
//! ratio below 0.75 times it.
//!
//! ```text
//! cargo test -p lockingkit-benches --bench smoke            # check (scripts/test.sh runs it)
//! cargo test -p lockingkit-benches --bench smoke -- record  # print fresh reference lines
//! ```
//!
//! It runs in the test profile, where `scripts/test.sh` has already built every dependency, so
//! CI pays for one more binary, not a release build of the tree. Its ratios are therefore its
//! own (unoptimised code on both sides of each ratio) and are recorded for that profile; the
//! table's ratios are `cargo bench`'s.
//!
//! A row measured outside its bound is measured again, up to three times in all, and passes
//! if any measurement is within it: machine noise moves one measurement, a regression moves
//! all three.

use std::collections::HashMap;
use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use lockingkit_benches::engine::in_memory_pairs_per_second;
use lockingkit_benches::http_load::{http_shape, in_memory_layer_cost};
use lockingkit_benches::mode::{in_task, two_worker_runtime, BenchMode};
use lockingkit_benches::postgres_modes::measure_modes;
use lockingkit_benches::postgres_pairs;
use lockingkit_benches::postgres_throughput::throughput;
use lockingkit_benches::transaction_locks::measure_transaction;
use lockingkit_benches::{azure_rows, etcd_rows, redis_rows};
use lockingkit_tests::azurite::Azurite;
use lockingkit_tests::etcd::EtcdCluster;
use lockingkit_tests::postgres::PostgresServer;
use lockingkit_tests::redis::RedisServer;

/// The recorded ratios, one `name ratio` line per row.
const REFERENCE: &str = include_str!("../smoke-reference.txt");

/// How much worse than recorded a ratio may be.
const TOLERANCE: f64 = 0.25;

/// Measurements of a row, at most.
const ATTEMPTS: usize = 3;

/// Latency pairs per variant (Azure's are fewer: each is milliseconds).
const PAIRS: usize = 1000;
const AZURE_PAIRS: usize = 60;

/// The load rows: rounds of each side, each this long, on this many connections or tasks. The
/// HTTP rows' ratio is the median of their rounds' ratios, so they take more rounds.
const LOAD_ROUNDS: usize = 3;
const LOAD_ROUND: Duration = Duration::from_millis(300);
const HTTP_ROUNDS: usize = 5;
const HTTP_CONNECTIONS: usize = 32;
const LOAD_TASKS: usize = 256;

/// Which way a ratio gets worse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Better {
    /// A latency over its baseline's: worse when it grows.
    Lower,
    /// A rate over its baseline's: worse when it falls.
    Higher,
}

/// One row's ratio in one measurement.
struct Measured {
    name: &'static str,
    better: Better,
    ratio: f64,
}

fn latency(name: &'static str, ratio: f64) -> Measured {
    Measured {
        name,
        better: Better::Lower,
        ratio,
    }
}

fn rate(name: &'static str, ratio: f64) -> Measured {
    Measured {
        name,
        better: Better::Higher,
        ratio,
    }
}

/// The recorded ratios by row name.
fn reference() -> HashMap<&'static str, f64> {
    REFERENCE
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .filter_map(|line| {
            let (name, ratio) = line.split_once(char::is_whitespace)?;
            Some((name, ratio.trim().parse().ok()?))
        })
        .collect()
}

/// Whether `ratio` is within the tolerance of the `recorded` one.
fn within(better: Better, ratio: f64, recorded: f64) -> bool {
    match better {
        Better::Lower => ratio <= recorded * (1.0 + TOLERANCE),
        Better::Higher => ratio >= recorded * (1.0 - TOLERANCE),
    }
}

/// Every measurement of one row, and what was recorded for it.
struct Verdict {
    name: &'static str,
    better: Better,
    ratios: Vec<f64>,
    recorded: Option<f64>,
}

impl Verdict {
    fn passed(&self) -> bool {
        self.recorded.is_some_and(|recorded| {
            self.ratios
                .iter()
                .any(|&ratio| within(self.better, ratio, recorded))
        })
    }

    fn print(&self) {
        let ratios: Vec<String> = self.ratios.iter().map(|r| format!("{r:.3}")).collect();
        let bound = match (self.recorded, self.better) {
            (Some(r), Better::Lower) => {
                format!("<= {:.3} (recorded {r:.3})", r * (1.0 + TOLERANCE))
            }
            (Some(r), Better::Higher) => {
                format!(">= {:.3} (recorded {r:.3})", r * (1.0 - TOLERANCE))
            }
            (None, _) => "no recorded ratio".to_owned(),
        };
        let result = if self.passed() { "ok" } else { "REGRESSED" };
        println!(
            "{:<24} {:<22} {:<34} {result}",
            self.name,
            ratios.join(" "),
            bound
        );
    }
}

/// Measures a group of rows until every one of them is within its bound, at most
/// [`ATTEMPTS`] times (or once, when recording).
async fn checked<F, Fut>(
    recorded: &HashMap<&'static str, f64>,
    once: bool,
    mut measure: F,
) -> Vec<Verdict>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Vec<Measured>>,
{
    let mut verdicts: Vec<Verdict> = Vec::new();
    for _ in 0..if once { 1 } else { ATTEMPTS } {
        for measured in measure().await {
            match verdicts.iter_mut().find(|v| v.name == measured.name) {
                Some(verdict) => verdict.ratios.push(measured.ratio),
                None => verdicts.push(Verdict {
                    name: measured.name,
                    better: measured.better,
                    ratios: vec![measured.ratio],
                    recorded: recorded.get(measured.name).copied(),
                }),
            }
        }
        if verdicts.iter().all(Verdict::passed) {
            break;
        }
    }
    verdicts
}

/// The PostgreSQL rows, on one server: pairs (row 1), readers and semaphores (row 10), the
/// transaction try-lock (row 11), throughput (row 7) and the locked HTTP route (row 8).
async fn postgres_rows(server: &PostgresServer) -> Vec<Measured> {
    let pairs = postgres_pairs::measure(server, PAIRS).await;
    let modes = measure_modes(server, PAIRS).await;
    let transaction = measure_transaction(server, PAIRS).await;
    let load = throughput(server, LOAD_TASKS, LOAD_ROUNDS, LOAD_ROUND).await;
    let http = http_shape(server, HTTP_CONNECTIONS, HTTP_ROUNDS, LOAD_ROUND).await;
    vec![
        latency("postgres-pair", pairs.ratio()),
        latency("postgres-pair-fenced", pairs.fenced_ratio()),
        latency("postgres-read", modes.shared_ratio()),
        latency("postgres-semaphore", modes.semaphore_ratio()),
        latency("transaction-unnamed", transaction.unnamed_ratio()),
        latency("transaction-prepared", transaction.prepared_ratio()),
        rate("postgres-throughput", load.ratio()),
        rate("http-postgres", http.rates.ratio()),
    ]
}

/// The Redis pair (row 12) and throughput (row 13).
async fn redis_rows(server: &RedisServer) -> Vec<Measured> {
    let pairs = redis_rows::measure(server, PAIRS).await;
    let load = redis_rows::throughput(server, LOAD_TASKS, LOAD_ROUNDS, LOAD_ROUND).await;
    vec![
        latency("redis-pair", pairs.ratio()),
        rate("redis-throughput", load.ratio()),
    ]
}

/// The rows with no server: in-memory pairs (row 3) and the HTTP layer's cost (row 9).
async fn engine_rows() -> Vec<Measured> {
    // It makes a runtime of its own, which a runtime's worker may not block on.
    let pairs = tokio::task::spawn_blocking(|| in_memory_pairs_per_second(20_000)).await;
    let (engine, raw) = pairs.unwrap_or_else(|panic| panic!("in-memory pairs: {panic}"));
    let http = in_memory_layer_cost(HTTP_CONNECTIONS, HTTP_ROUNDS, LOAD_ROUND).await;
    vec![
        rate("memory-pairs", engine / raw),
        rate("http-memory", http.ratio()),
    ]
}

async fn every_row(once: bool) -> Vec<Verdict> {
    let recorded = reference();
    let mut verdicts = checked(&recorded, once, engine_rows).await;
    let server = PostgresServer::start().await;
    // A fresh server's first statements of each kind are slow (catalog caches, plans): one
    // short pass of the latency rows first, unrecorded.
    postgres_pairs::measure(&server, PAIRS / 10).await;
    measure_modes(&server, PAIRS / 10).await;
    measure_transaction(&server, PAIRS / 10).await;
    verdicts.extend(checked(&recorded, once, || postgres_rows(&server)).await);
    drop(server);
    let server = RedisServer::start().await;
    verdicts.extend(checked(&recorded, once, || redis_rows(&server)).await);
    drop(server);
    let etcd = EtcdCluster::single().await;
    let etcd_pair = || async {
        let (ours, raw) = etcd_rows::pairs(&etcd, PAIRS / 2).await;
        vec![latency("etcd-pair", ours.as_secs_f64() / raw.as_secs_f64())]
    };
    verdicts.extend(checked(&recorded, once, etcd_pair).await);
    drop(etcd);
    let azurite = Azurite::start().await;
    let azure_pair = || async {
        let pairs = azure_rows::measure(&azurite, AZURE_PAIRS).await;
        vec![latency("azure-pair", pairs.ratio())]
    };
    verdicts.extend(checked(&recorded, once, azure_pair).await);
    verdicts
}

fn main() -> ExitCode {
    if BenchMode::from_args().is_none() {
        return ExitCode::SUCCESS;
    }
    let record = std::env::args().any(|arg| arg == "record");
    let verdicts = in_task(&two_worker_runtime(), "the smoke table", every_row(record));
    if record {
        println!("# row                    ratio to its own baseline");
        for verdict in &verdicts {
            println!("{:<24} {:.3}", verdict.name, verdict.ratios[0]);
        }
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<24} {:<22} {:<34} result",
        "row", "ratios measured", "bound"
    );
    for verdict in &verdicts {
        verdict.print();
    }
    let regressed: Vec<&str> = verdicts
        .iter()
        .filter(|v| !v.passed())
        .map(|v| v.name)
        .collect();
    if regressed.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "bench-smoke: regressed by more than {:.0}% against the recorded ratio: {}",
            TOLERANCE * 100.0,
            regressed.join(", ")
        );
        ExitCode::FAILURE
    }
}
