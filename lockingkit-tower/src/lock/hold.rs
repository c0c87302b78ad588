//! `Hold`: how a layer holds each request's key — alone, together with other readers, or as
//! one slot of a semaphore — checked against the provider when the layer is built.

use std::time::Duration;

use lockingkit::{DistributedLock, LockError, LockHandle, LockMode, ReaderWriterLock};

/// A key that passes every key check, used only to ask the core whether a semaphore of some
/// size is possible on a provider. Making a `DistributedSemaphore` sends nothing to the
/// backend, so this takes nothing and locks nothing.
const CAPABILITY_PROBE_KEY: &str = "lockingkit-tower/capability-probe";

/// How a [`LockLayer`](crate::LockLayer) holds the key of each request.
#[derive(Clone)]
pub(crate) enum Hold {
    /// The key's plain lock: the only holder (the default; also a reader-writer lock's writer).
    Exclusive,
    /// A reader of the key: any number of requests hold it together, none while it is locked
    /// exclusively. Keeping the `ReaderWriterLock` is the proof that the provider can do it.
    Shared(ReaderWriterLock),
    /// One of at most `max_count` slots of the semaphore named by the key.
    Slot { max_count: u32 },
}

impl Hold {
    /// Reading, if `locks` can hold shared locks; `Misconfigured` otherwise.
    pub(crate) fn shared(locks: &DistributedLock) -> Result<Self, LockError> {
        locks.reader_writer().map(Hold::Shared)
    }

    /// Slots of a semaphore of `max_count`, if `locks` can hold one; `Misconfigured` otherwise,
    /// or if `max_count` is out of range.
    pub(crate) fn slot(locks: &DistributedLock, max_count: u32) -> Result<Self, LockError> {
        // The semaphore's key is only known per request, but whether the provider can hold a
        // semaphore of this size does not depend on it: asking now refuses a layer that would
        // answer 500 to every request.
        locks.semaphore(CAPABILITY_PROBE_KEY, max_count)?;
        Ok(Hold::Slot { max_count })
    }

    /// The mode this hold takes keys in.
    pub(crate) fn mode(&self) -> LockMode {
        match self {
            Hold::Exclusive => LockMode::Exclusive,
            Hold::Shared(_) => LockMode::Shared,
            Hold::Slot { max_count } => LockMode::Semaphore {
                max_count: *max_count,
            },
        }
    }

    /// Takes `key` in this hold's mode: one attempt, or waiting up to `wait`.
    pub(crate) async fn take(
        &self,
        locks: &DistributedLock,
        key: &str,
        wait: Option<Duration>,
    ) -> Result<LockHandle, LockError> {
        match (self, wait) {
            (Hold::Exclusive, None) => locks.try_acquire(key).await,
            (Hold::Exclusive, Some(timeout)) => locks.acquire(key, timeout).await,
            (Hold::Shared(readers), None) => readers.try_read(key).await,
            (Hold::Shared(readers), Some(timeout)) => readers.read(key, timeout).await,
            (Hold::Slot { max_count }, wait) => {
                // Validates the derived key as any lock does: an invalid one is a 400.
                let semaphore = locks.semaphore(key, *max_count)?;
                match wait {
                    None => semaphore.try_acquire().await,
                    Some(timeout) => semaphore.acquire(timeout).await,
                }
            }
        }
    }
}

/// Whether holds in modes `a` and `b` of one key name the same thing: locks (exclusive or
/// shared) and semaphores live in separate namespaces.
pub(crate) fn same_namespace(a: LockMode, b: LockMode) -> bool {
    let is_semaphore = |mode| matches!(mode, LockMode::Semaphore { .. });
    is_semaphore(a) == is_semaphore(b)
}
