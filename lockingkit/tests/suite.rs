//! lockingkit's integration tests, one module per subject, built as one test binary: one link
//! instead of one per file keeps the build short on a small machine. nextest still runs each
//! test in its own process.

mod support {
    pub mod field_log;
    pub mod queue;
    pub mod watched;
}

mod abandoned;
mod contract_memory;
mod durations;
mod engine;
mod leader;
mod manifest;
mod multi;
mod outages;
mod shutdown;
mod telemetry;
