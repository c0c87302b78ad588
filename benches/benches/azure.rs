//! LockingKit's Azure acquire+release next to the raw SDK sending the same requests, against
//! one Azurite in one run (method in `lockingkit_benches::azure_rows`).
//!
//! ```text
//! scripts/setup-azurite.sh && cargo bench -p lockingkit-benches --bench azure
//! ```
//!
//! Without `--bench` (`cargo test --all-targets`) it runs a few pairs as a smoke test; it lists
//! no tests to nextest.

use lockingkit_benches::azure_rows::measure;
use lockingkit_benches::mode::{two_worker_runtime, BenchMode};
use lockingkit_tests::azurite::Azurite;

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
