//! How a benchmark program was invoked, and the runtime the backend rows measure on.

use std::future::Future;

/// How a harness-less benchmark binary was invoked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchMode {
    /// `cargo bench`: measure for real.
    Full,
    /// `cargo test --all-targets`: a few samples, to know it still works.
    Smoke,
}

impl BenchMode {
    /// The mode from the process arguments; `None` when a test runner (nextest) only asks
    /// for the binary's test list, of which there is none.
    pub fn from_args() -> Option<BenchMode> {
        let args: Vec<String> = std::env::args().collect();
        if args.iter().any(|a| a == "--list") {
            return None;
        }
        Some(if args.iter().any(|a| a == "--bench") {
            BenchMode::Full
        } else {
            BenchMode::Smoke
        })
    }

    /// `full` when measuring for real, `smoke` otherwise.
    pub fn pick<T>(self, full: T, smoke: T) -> T {
        match self {
            BenchMode::Full => full,
            BenchMode::Smoke => smoke,
        }
    }
}

/// The two-worker multi-thread runtime the backend benchmarks measure on.
pub fn two_worker_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Runs `measured` to its end inside a task of `runtime`, as application code runs, not on the
/// thread that blocks on the runtime: otherwise every answer would cross threads to reach the
/// caller. `what` names the measurement if it panics.
pub fn in_task<T: Send + 'static>(
    runtime: &tokio::runtime::Runtime,
    what: &str,
    measured: impl Future<Output = T> + Send + 'static,
) -> T {
    runtime
        .block_on(async { tokio::spawn(measured).await })
        .unwrap_or_else(|panic| panic!("{what}: {panic}"))
}
