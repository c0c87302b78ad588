//! Extractors: the held lock (or locks) of a request, and their rejections.

mod held_lock;
mod held_locks;
pub mod rejection;

pub use self::held_lock::HeldLock;
pub use self::held_locks::HeldLocks;
