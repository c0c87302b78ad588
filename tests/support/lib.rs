//! Test fixtures shared by the integration suites: real backends started on loopback.
#![allow(missing_docs)]

pub mod azurite;
pub mod bench;
pub mod bench_azure;
pub mod bench_etcd;
pub mod bench_patterns;
pub mod bench_postgres;
pub mod bench_redis;
pub mod bench_sessions;
pub mod bench_transaction;
pub mod chaos;
pub mod contract;
pub mod etcd;
// The log capture lives with the telemetry suite in `lockingkit/tests`; the Azure suite uses it too.
#[path = "../../lockingkit/tests/support/field_log.rs"]
pub mod field_log;
pub mod http;
pub mod os;
pub mod pgbouncer;
pub mod polling;
pub mod postgres;
pub mod proxy;
pub mod redis;
