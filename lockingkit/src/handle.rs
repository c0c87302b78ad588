//! `LockHandle` and `LockView`: a hold of one key, owned (the handle, which releases it) or
//! looked at (the view, which cannot).

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::backend::LockMode;
use crate::background::Orphanable;
#[cfg(doc)]
use crate::error::ErrorKind;
use crate::error::LockError;
use crate::telemetry::LossReason;

/// What the engine keeps for one held lock, seen without its backend type.
pub(crate) trait AnyHold: Send + Sync {
    fn key(&self) -> &str;
    fn mode(&self) -> LockMode;
    fn fencing_token(&self) -> u64;
    fn lost_token(&self) -> &CancellationToken;
    fn is_held(&self) -> bool;
    fn loss_reason(&self) -> Option<LossReason>;
    /// Claims the lock for release before returning, then releases when polled (or in the
    /// background if the returned future is dropped first).
    fn release(self: Arc<Self>) -> Orphanable<Result<(), LockError>>;
    fn release_in_background(self: Arc<Self>);
    fn lease(&self) -> &(dyn std::any::Any + Send + Sync);
    /// The address of the engine that holds the lock, which identifies its provider.
    fn engine_address(&self) -> usize;
    fn key_digest(&self) -> Option<&str>;
}

/// A held distributed lock: the owner of one hold.
///
/// A handle is the proof of holding a lock, so it is neither `Clone` nor `Copy`. What it tells
/// about the lock — key, mode, fencing token, loss signal, [`run`](LockView::run) — is its
/// [`LockView`]'s, reached through `Deref`; the handle adds what only the holder may do:
/// [`release`](Self::release). While it
/// exists the engine keeps the lock alive in the background: it renews expiring leases (every
/// third of the lease by default) or checks the held connection, and declares the lock lost when
/// it can no longer vouch for it.
///
/// # Loss
/// The lock is *lost* when a renewal or check tells the engine the lease is gone, or when no
/// renewal has succeeded for 90% of the lease since the last successful one was sent. A
/// separate timer enforces that deadline, so a renewal that never returns cannot postpone it.
/// On loss [`lost_token`](LockView::lost_token) fires, [`is_held`](LockView::is_held) turns
/// `false`, [`ensure_held`](LockView::ensure_held) returns [`ErrorKind::Lost`] and
/// [`run`](LockView::run) drops its work. A lost lock is never re-acquired behind your back.
///
/// # Release and drop
/// [`release`](Self::release) gives the lock up and reports whether the backend confirmed it.
/// Dropping the handle releases it in the background instead, on the runtime the lock was taken
/// on; the next local waiter for the key gets its turn as soon as the release completes. Either
/// way the lost token fires first, so work tied to it stops before the lock is given up.
/// Releasing is idempotent: a handle is released at most once, and a lost handle is not
/// released again.
///
/// # Fencing
/// [`fencing_token`](LockView::fencing_token) is strictly greater than every token handed out
/// earlier for the same key. A lease lock cannot stop a process that was paused (GC, VM
/// suspension) from waking up and carrying on; a resource that rejects tokens lower than the
/// highest it has seen can.
///
/// ```
/// # async fn demo() -> Result<(), lockingkit::LockError> {
/// let locks = lockingkit::DistributedLock::in_memory();
/// let handle = locks.try_acquire("orders/42").await?;
/// let token = handle.fencing_token();
/// let shipped = handle.run(async move { /* write with `token` */ token }).await?;
/// handle.release().await?;
/// # let _ = shipped; Ok(()) }
/// ```
pub struct LockHandle {
    view: LockView,
}

impl LockHandle {
    pub(crate) fn new(held: Arc<dyn AnyHold>) -> Self {
        LockHandle {
            view: LockView { held },
        }
    }

    /// A cloneable view of this lock, for code that must watch the lock without owning it
    /// (a spawned task, a request's extensions). The view never releases; the handle does.
    pub fn view(&self) -> LockView {
        self.view.clone()
    }

    /// Releases the lock and waits for the backend to confirm.
    ///
    /// `Ok` means the backend confirmed the release. An error means it did not: kind
    /// [`ErrorKind::Lost`] if the lock had already been lost, [`ErrorKind::Unavailable`] if the
    /// backend did not answer in time. In every case the handle stops holding the lock, and
    /// the backend frees it when the lease expires or the connection closes. If this future is
    /// dropped before it finishes, the release carries on in the background.
    pub async fn release(self) -> Result<(), LockError> {
        // `release` claims the lock synchronously, so the handle's own `Drop` (when `self` goes
        // out of scope here) finds it claimed and does not start a second, background release.
        let release = self.view.held.clone().release();
        drop(self);
        release.await
    }
}

impl std::ops::Deref for LockHandle {
    type Target = LockView;

    fn deref(&self) -> &LockView {
        &self.view
    }
}

impl Drop for LockHandle {
    fn drop(&mut self) {
        self.view.held.clone().release_in_background();
    }
}

impl fmt::Debug for LockHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is left out on purpose: keys routinely carry customer ids.
        f.debug_struct("LockHandle")
            .field("mode", &self.mode())
            .field("fencing_token", &self.fencing_token())
            .field("is_held", &self.is_held())
            .finish_non_exhaustive()
    }
}

/// A cloneable, read-only view of a held lock: its key, mode, fencing token and loss signal.
///
/// Made by [`LockHandle::view`]. A view answers like the handle it came from — [`is_held`]
/// turns `false` on loss, on release and at the loss deadline — but it cannot release the lock,
/// and it does not keep the lock alive: dropping the handle releases the lock whatever views
/// remain. It is what code that watches a hold without owning it is given: a spawned task, a
/// leader's [`Term`](crate::Term), and the handler behind an HTTP lock layer (in the request
/// extensions).
///
/// [`is_held`]: Self::is_held
#[derive(Clone)]
pub struct LockView {
    held: Arc<dyn AnyHold>,
}

impl LockView {
    /// The key of the lock.
    pub fn key(&self) -> &str {
        self.held.key()
    }

    /// How the lock is held: [`LockMode::Exclusive`] for a plain lock or a writer,
    /// [`LockMode::Shared`] for a reader, [`LockMode::Semaphore`] for a semaphore slot.
    ///
    /// ```
    /// # async fn demo() -> Result<(), lockingkit::LockError> {
    /// use lockingkit::LockMode;
    /// let locks = lockingkit::DistributedLock::in_memory();
    /// let reader = locks.reader_writer("orders/42")?.try_read().await?;
    /// assert_eq!(reader.mode(), LockMode::Shared);
    /// assert_eq!(reader.view().mode(), LockMode::Shared);
    /// # Ok(()) }
    /// ```
    pub fn mode(&self) -> LockMode {
        self.held.mode()
    }

    /// The fencing token of the hold; strictly greater than every earlier token for the key.
    pub fn fencing_token(&self) -> u64 {
        self.held.fencing_token()
    }

    /// A token that is cancelled when the lock is lost or released.
    ///
    /// Each call returns a child of the hold's own token, so cancelling what you were given
    /// affects only your copy, never the hold.
    pub fn lost_token(&self) -> CancellationToken {
        self.held.lost_token().child_token()
    }

    /// Whether the lock is still held: not lost, not released, and within its loss deadline.
    pub fn is_held(&self) -> bool {
        self.held.is_held()
    }

    /// Why the lock was lost, once it has been.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.held.loss_reason()
    }

    /// `Ok(())` while the lock is held, `Err` of kind [`ErrorKind::Lost`] after.
    pub fn ensure_held(&self) -> Result<(), LockError> {
        if self.is_held() {
            Ok(())
        } else {
            Err(LockError::lost(self.held.loss_reason()))
        }
    }

    /// The backend's own lease behind this lock, if the backend's lease type is `L`. A handle
    /// reaches it through its view, so both have it.
    ///
    /// Provider-specific details live here without the core knowing any provider: the Azure
    /// provider's [`azure_blob_lease`](LockHandle::azure_blob_lease) is built on it, and a custom
    /// backend's users can read its lease type the same way.
    ///
    /// ```
    /// # async fn demo() -> Result<(), lockingkit::LockError> {
    /// use lockingkit::providers::memory::MemoryLease;
    /// let locks = lockingkit::DistributedLock::in_memory();
    /// let handle = locks.try_acquire("orders/42").await?;
    /// assert!(handle.lease::<MemoryLease>().is_some());
    /// assert!(handle.view().lease::<MemoryLease>().is_some());
    /// assert!(handle.lease::<String>().is_none());
    /// # Ok(()) }
    /// ```
    pub fn lease<L: std::any::Any>(&self) -> Option<&L> {
        self.held.lease().downcast_ref::<L>()
    }

    /// The keyed digest of the key (`lockingkit.key.digest`), if the provider was built with
    /// [`key_digests`](crate::DistributedLockBuilder::key_digests): for log lines about the
    /// lock that must not carry its key.
    pub fn key_digest(&self) -> Option<&str> {
        self.held.key_digest()
    }

    /// Whether this lock was taken through `locks` (or a clone of it): the same provider, whose
    /// keys are the same locks. Two layers of one request can tell with it that they would lock
    /// the same key twice.
    pub fn is_from(&self, locks: &crate::DistributedLock) -> bool {
        self.held.engine_address() == locks.engine_address()
    }

    /// Runs `work` while the lock is held, dropping it the moment the lock is lost or released.
    ///
    /// Returns `Err` of kind [`ErrorKind::Lost`] if the lock was lost before `work` finished;
    /// `work` is then dropped at its current `.await` point. When the loss and the end of
    /// `work` are seen at once, loss wins: a result produced without the lock is not returned.
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output, LockError> {
        self.ensure_held()?;
        let lost = self.held.lost_token();
        tokio::select! {
            biased;
            _ = lost.cancelled() => Err(LockError::lost(self.held.loss_reason())),
            output = work => Ok(output),
        }
    }
}

impl fmt::Debug for LockView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is left out on purpose: keys routinely carry customer ids.
        f.debug_struct("LockView")
            .field("mode", &self.mode())
            .field("fencing_token", &self.fencing_token())
            .field("is_held", &self.is_held())
            .finish_non_exhaustive()
    }
}
