//! Extractors: the held lock of a request, and its rejections.

mod held_lock;
pub mod rejection;

pub use self::held_lock::HeldLock;
