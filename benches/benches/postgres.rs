//! LockingKit's PostgreSQL try_acquire+release next to raw prepared advisory-lock statements,
//! against one throwaway server in one run (method in `lockingkit_benches::postgres_pairs`),
//! then throughput on many keys (`postgres_throughput`) and the HTTP shape (`http_load`).
//!
//! ```text
//! scripts/setup-postgres.sh && cargo bench -p lockingkit-benches --bench postgres
//! ```
//!
//! Without `--bench` (`cargo test --all-targets`) it runs a few pairs as a smoke test; it lists
//! no tests to nextest.

use std::time::Duration;

use lockingkit_benches::http_load::http_shape;
use lockingkit_benches::mode::{two_worker_runtime, BenchMode};
use lockingkit_benches::postgres_pairs::measure;
use lockingkit_benches::postgres_throughput::throughput;
use lockingkit_tests::postgres::PostgresServer;

fn main() {
    let Some(mode) = BenchMode::from_args() else {
        return;
    };
    let pairs = mode.pick(5000, 5);
    let (rounds, round) = mode.pick((3, Duration::from_secs(2)), (1, Duration::from_millis(100)));
    let runtime = two_worker_runtime();
    runtime.block_on(async {
        // Measured inside a task, as application code runs, not on the thread that blocks on
        // the runtime: otherwise every answer would cross threads to reach the caller.
        let (report, throughput, http) = tokio::spawn(async move {
            let server = PostgresServer::start().await;
            let report = measure(&server, pairs).await;
            let throughput = throughput(&server, 256, rounds, round).await;
            let http = http_shape(&server, 32, rounds, round).await;
            (report, throughput, http)
        })
        .await
        .expect("the benchmark task panicked");
        println!("{}", report.render());
        println!(
            "256 tasks on distinct keys: lockingkit {:.0} pairs/s on {} sessions, raw {:.0} pairs/s on {} connections, ratio {:.3}",
            throughput.lockingkit_pairs_per_s,
            throughput.lockingkit_connections,
            throughput.raw_pairs_per_s,
            throughput.raw_connections,
            throughput.ratio()
        );
        println!(
            "HTTP, 32 connections: lock_route {:.0}/s, no layer {:.0}/s, ratio {:.3}; CPU per request: app {:.1} µs (no layer {:.1} µs), PostgreSQL {:.1} µs",
            http.rates.locked_per_s,
            http.rates.plain_per_s,
            http.rates.ratio(),
            http.rates.locked_cpu.as_secs_f64() * 1e6,
            http.rates.plain_cpu.as_secs_f64() * 1e6,
            http.locked_server_cpu.as_secs_f64() * 1e6
        );
    });
}
