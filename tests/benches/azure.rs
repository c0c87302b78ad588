//! LockingKit's Azure acquire+release next to the raw SDK sending the same requests, against
//! one Azurite in one run (method in `lockingkit_tests::bench_azure`).
//!
//! ```text
//! scripts/setup-azurite.sh && cargo bench -p lockingkit-tests --bench azure
//! ```
//!
//! Without `--bench` (`cargo test --all-targets`) it runs a few pairs as a smoke test; it lists
//! no tests to nextest.

use lockingkit_tests::azurite::Azurite;
use lockingkit_tests::bench::{two_worker_runtime, BenchMode};
use lockingkit_tests::bench_azure::measure;

fn main() {
    let Some(mode) = BenchMode::from_args() else {
        return;
    };
    let pairs = mode.pick(400, 5);
    let runtime = two_worker_runtime();
    runtime.block_on(async {
        let azurite = Azurite::start().await;
        let report = measure(&azurite, pairs).await;
        println!("{}", report.render());
    });
}
