//! Test fixtures shared by the integration suites and the benchmarks (`lockingkit-benches`):
//! real backends started on loopback.
#![allow(missing_docs)]

pub mod azurite;
pub mod chaos;
pub mod checks;
pub mod contract;
pub mod etcd;
// The log capture lives with the telemetry suite in `lockingkit/tests`; the Azure suite uses it too.
#[path = "../../lockingkit/tests/support/field_log.rs"]
pub mod field_log;
pub mod http;
pub mod mariadb;
pub mod os;
pub mod pgbouncer;
pub mod polling;
pub mod postgres;
pub mod proxy;
pub mod redis;
pub mod server;
