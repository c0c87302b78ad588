//! Distributed locks for async Rust.
//!
//! One lock type, [`DistributedLock`], runs unchanged on six providers: in-memory (always
//! built), PostgreSQL advisory locks (feature `postgres`, directly or through PgBouncer), MySQL
//! and MariaDB named locks (feature `mysql`), Azure Blob leases (feature `azure`), Redis, one
//! server or a Redis Cluster (feature `redis`), and etcd, one member or a cluster (feature
//! `etcd`). One engine does the hard parts for every backend: waiting with capped, jittered
//! backoff behind a local first-come-first-served queue; renewal in the background; loss
//! detection with a deadline timer that a hung renewal cannot postpone; release on drop; and
//! telemetry.
//!
//! Every provider passes the same contract suite ([`testing`], feature `testing`) against real
//! servers the repository's tests start: PostgreSQL directly and through PgBouncer, MariaDB,
//! Azurite (the Azure Storage emulator), a Redis server and a three-master Redis Cluster, and
//! etcd clusters of one member and of three.
//!
//! ```
//! use std::time::Duration;
//! use lockingkit::DistributedLock;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), lockingkit::LockError> {
//! let locks = DistributedLock::in_memory();
//! let handle = locks.acquire("jobs/nightly-export", Duration::from_secs(30)).await?;
//! for batch in 0..3 {
//!     handle.ensure_held()?; // stop instead of working unprotected
//!     let _ = (batch, handle.fencing_token()); // send the token with every write
//! }
//! handle.release().await?;
//! # Ok(()) }
//! ```
//!
//! See the crate README for the guarantees a lease lock can and cannot give.

#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

pub mod backend;
mod background;
mod backoff;
mod clock;
pub mod config;
mod engine;
mod error;
mod handle;
mod health;
pub mod keys;
mod leader;
mod lock;
mod multi;
pub mod providers;
mod reader_writer;
pub mod registry;
mod semaphore;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(any(feature = "postgres", feature = "redis"))]
mod tls;

pub use backend::LockMode;
pub use engine::LockOptions;
pub use error::{ErrorKind, LockError};
pub use handle::{LockHandle, LockView};
pub use leader::{Campaign, LeaderState, Leadership, Term};
pub use lock::{DistributedLock, DistributedLockBuilder};
pub use multi::{MultiLockHandle, MultiLockView};
#[cfg(feature = "azure")]
pub use providers::azure::{AzureBlobBackend, AzureBlobOptions};
#[cfg(feature = "etcd")]
pub use providers::etcd::{EtcdBackend, EtcdOptions};
pub use providers::memory::{MemoryBackend, MemoryStore};
#[cfg(feature = "mysql")]
pub use providers::mysql::{MysqlBackend, MysqlOptions};
#[cfg(feature = "postgres")]
pub use providers::postgres::{PostgresBackend, PostgresOptions};
#[cfg(feature = "redis")]
pub use providers::redis::{RedisBackend, RedisOptions};
pub use reader_writer::ReaderWriterLock;
pub use registry::{Locking, LockingConfig};
pub use semaphore::DistributedSemaphore;
pub use telemetry::LossReason;
pub use tokio_util::sync::CancellationToken;

/// The README's Rust examples, compiled as doc tests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

/// The guides' examples, compiled as doc tests with the features they need (the PostgreSQL
/// guide's include a deadpool-postgres transaction).
#[cfg(all(doctest, feature = "deadpool"))]
#[doc = include_str!("../../docs/postgres.md")]
pub struct PostgresGuideDoctests;

#[cfg(all(doctest, feature = "azure"))]
#[doc = include_str!("../../docs/azure.md")]
pub struct AzureGuideDoctests;

#[cfg(all(doctest, feature = "etcd"))]
#[doc = include_str!("../../docs/etcd.md")]
pub struct EtcdGuideDoctests;
#[cfg(all(doctest, feature = "redis"))]
#[doc = include_str!("../../docs/redis.md")]
pub struct RedisGuideDoctests;

#[cfg(all(doctest, feature = "mysql"))]
#[doc = include_str!("../../docs/mysql.md")]
pub struct MysqlGuideDoctests;

#[cfg(doctest)]
#[doc = include_str!("../../docs/telemetry.md")]
pub struct TelemetryGuideDoctests;
