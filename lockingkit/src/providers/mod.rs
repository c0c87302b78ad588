//! Backends behind the [`LockBackend`](crate::backend::LockBackend) trait.

pub mod memory;

#[cfg(feature = "azure")]
pub mod azure;
#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
