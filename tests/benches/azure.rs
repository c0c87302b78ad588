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
use lockingkit_tests::bench_azure::measure;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        // nextest asks a harness-less target for its tests: there are none.
        return;
    }
    let pairs = if args.iter().any(|a| a == "--bench") {
        400
    } else {
        5
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let azurite = Azurite::start().await;
        let report = measure(&azurite, pairs).await;
        println!("{}", report.render());
    });
}
