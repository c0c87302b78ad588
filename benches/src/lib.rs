//! LockingKit's benchmarks: each performance goal measured next to its baseline in the same
//! run, against the throwaway servers of `lockingkit-tests`' fixtures. The programs in
//! `benches/benches/` print the rows (docs/performance.md); this library holds the
//! measurements, one module per row or group of rows, on a few shared pieces: how a pair is
//! taken (`pair`), how samples are taken and summed up (`samples`), load over many tasks
//! (`load`) and how a row prints (`table`).
#![deny(missing_docs)]

pub mod allocations;
pub mod azure_rows;
pub mod cpus;
pub mod engine;
pub mod etcd_rows;
pub mod handoff;
pub mod http_load;
pub mod load;
pub mod mode;
pub mod mysql_rows;
pub mod pair;
pub mod patterns;
pub mod postgres_modes;
pub mod postgres_pairs;
pub mod postgres_throughput;
pub mod redis_rows;
pub mod samples;
pub mod table;
pub mod transaction_locks;
