//! LockingKit's PostgreSQL try_acquire+release next to raw prepared advisory-lock statements,
//! against one throwaway server in one run (method in `lockingkit_tests::bench_postgres`).
//!
//! ```text
//! scripts/setup-postgres.sh && cargo bench -p lockingkit-tests --bench postgres
//! ```
//!
//! Without `--bench` (`cargo test --all-targets`) it runs a few pairs as a smoke test; it lists
//! no tests to nextest.

use lockingkit_tests::bench_postgres::measure;
use lockingkit_tests::postgres::PostgresServer;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        // nextest asks a harness-less target for its tests: there are none.
        return;
    }
    let pairs = if args.iter().any(|a| a == "--bench") {
        5000
    } else {
        5
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
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
