//! lockingkit-tower's integration tests, one module per subject, built as one test binary: one
//! link instead of one per file keeps the build short on a small machine. nextest still runs
//! each test in its own process.

mod support;

mod durations;
mod http;
mod modes;
mod service;
