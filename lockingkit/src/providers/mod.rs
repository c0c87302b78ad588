//! Backends behind the [`LockBackend`](crate::LockBackend) trait.

pub mod memory;
