//! Backends behind the [`LockBackend`](crate::backend::LockBackend) trait.

pub mod memory;

#[cfg(feature = "azure")]
pub mod azure;
#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) mod reconnect;
#[cfg(feature = "redis")]
pub mod redis;
