//! LockingKit's PostgreSQL try_acquire+release next to raw prepared advisory-lock statements,
//! against one throwaway server in one run (method in `lockingkit_tests::bench_postgres`).
//!
//! ```text
//! scripts/setup-postgres.sh && cargo bench -p lockingkit-tests --bench postgres
//! ```
//!
//! Without `--bench` (`cargo test --all-targets`) it runs a few pairs as a smoke test; it lists
//! no tests to nextest.

use lockingkit_tests::bench::{two_worker_runtime, BenchMode};
use lockingkit_tests::bench_postgres::measure;
use lockingkit_tests::postgres::PostgresServer;

fn main() {
    let Some(mode) = BenchMode::from_args() else {
        return;
    };
    let pairs = mode.pick(5000, 5);
    let runtime = two_worker_runtime();
    runtime.block_on(async {
        // Measured inside a task, as application code runs, not on the thread that blocks on
        // the runtime: otherwise every answer would cross threads to reach the caller.
        let report = tokio::spawn(async move {
            let server = PostgresServer::start().await;
            measure(&server, pairs).await
        })
        .await
        .expect("the benchmark task panicked");
        println!("{}", report.render());
    });
}
