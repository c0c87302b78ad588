//! Multi-key holds: several keys taken as one, in a canonical order, all or nothing.
//!
//! Built on the public engine surface — one [`DistributedLock::acquire_in`] per key, in order —
//! so it works on every provider and in every lock mode, and each key keeps its own waiting
//! room (local waiters of a key are still served first come, first served).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::LockMode;
#[cfg(doc)]
use crate::error::ErrorKind;
use crate::error::LockError;
use crate::handle::{LockHandle, LockView};
use crate::keys::validate_key;
use crate::lock::DistributedLock;
use crate::telemetry::LossReason;

/// The keys of a multi-key hold in the order they are taken: sorted byte-wise (the order of
/// `str`, which compares UTF-8 bytes), duplicates folded into one. Keys are compared byte for
/// byte everywhere in the engine, so two keys that sort apart here are two locks, and every
/// process that asks for the same set takes it in the same order.
///
/// Fails with [`ErrorKind::InvalidKey`] for an empty list or any key outside 1–512
/// characters, before anything is sent.
pub(crate) fn canonical_order<K: AsRef<str>>(keys: &[K]) -> Result<Vec<&str>, LockError> {
    if keys.is_empty() {
        return Err(LockError::new(
            crate::error::ErrorKind::InvalidKey,
            "a multi-key lock needs at least one key",
        ));
    }
    let mut ordered = Vec::with_capacity(keys.len());
    for key in keys {
        let key = key.as_ref();
        validate_key(key)?;
        ordered.push(key);
    }
    ordered.sort_unstable();
    ordered.dedup();
    Ok(ordered)
}

impl DistributedLock {
    /// Makes one attempt at each of `keys`, as one hold: all of them or none.
    ///
    /// The keys are taken in their canonical order (sorted byte-wise, duplicates folded into
    /// one), so two callers that name the same keys in different orders never deadlock. If
    /// one is busy or fails, the keys already taken are released (and the release awaited)
    /// before the error returns: [`ErrorKind::Busy`] if any key is held by anyone, including
    /// this process. Fails with [`ErrorKind::InvalidKey`] for an empty list or a bad key,
    /// before any request. Dropping the future at any point leaks no key.
    pub async fn try_acquire_all<K: AsRef<str>>(
        &self,
        keys: &[K],
    ) -> Result<MultiLockHandle, LockError> {
        self.take_all(keys, LockMode::Exclusive, None).await
    }

    /// Waits up to `timeout`, in all, for every one of `keys`, as one hold: all of them or
    /// none.
    ///
    /// The keys are taken one after another in their canonical order (sorted byte-wise,
    /// duplicates folded), each waited for as [`acquire`](Self::acquire) waits, with what is
    /// left of `timeout`. The canonical order is what prevents deadlock: every caller that
    /// needs two of the same keys asks for the lower one first. A caller that already holds
    /// one of these keys on its own (outside this call) breaks that order, and can deadlock
    /// against a caller of `acquire_all` — take them all in one call instead.
    ///
    /// On timeout or failure the keys already taken are released (and the release awaited)
    /// before the error returns; the error is the one the unfinished key's wait ended with
    /// ([`ErrorKind::Timeout`], [`ErrorKind::Unavailable`], …). Dropping the future at any
    /// point leaks no key.
    pub async fn acquire_all<K: AsRef<str>>(
        &self,
        keys: &[K],
        timeout: Duration,
    ) -> Result<MultiLockHandle, LockError> {
        self.take_all(keys, LockMode::Exclusive, Some(timeout))
            .await
    }

    /// [`try_acquire_all`](Self::try_acquire_all) in `mode`: every key taken in the same mode
    /// (see [`try_acquire_in`](Self::try_acquire_in)).
    pub async fn try_acquire_all_in<K: AsRef<str>>(
        &self,
        keys: &[K],
        mode: LockMode,
    ) -> Result<MultiLockHandle, LockError> {
        self.take_all(keys, mode, None).await
    }

    /// [`acquire_all`](Self::acquire_all) in `mode`: every key taken in the same mode (see
    /// [`acquire_in`](Self::acquire_in)).
    pub async fn acquire_all_in<K: AsRef<str>>(
        &self,
        keys: &[K],
        mode: LockMode,
        timeout: Duration,
    ) -> Result<MultiLockHandle, LockError> {
        self.take_all(keys, mode, Some(timeout)).await
    }

    /// Takes every key in canonical order, one attempt each (`timeout` `None`) or waiting
    /// with what is left of the timeout. A key not taken releases those taken before it.
    async fn take_all<K: AsRef<str>>(
        &self,
        keys: &[K],
        mode: LockMode,
        timeout: Option<Duration>,
    ) -> Result<MultiLockHandle, LockError> {
        let ordered = canonical_order(keys)?;
        self.ensure_supports(mode)?;
        let deadline = timeout.map(crate::clock::in_);
        // Held members sit in this vector: if the caller drops the future, dropping the
        // vector releases them in the background, so no exit leaks a key.
        let mut held = Vec::with_capacity(ordered.len());
        for key in ordered {
            let taken = match deadline {
                None => self.try_acquire_in(key, mode).await,
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    self.acquire_in(key, mode, left).await
                }
            };
            match taken {
                Ok(handle) => held.push(handle),
                Err(error) => {
                    // All or nothing: the error returns only once the backend has answered
                    // the releases, so the keys are free for the next caller when it does.
                    let _ = release_all(held).await;
                    return Err(error);
                }
            }
        }
        MultiLockHandle::new(held, mode)
    }
}

/// Releases every handle at once and waits for all; the first failure, if any.
async fn release_all(handles: Vec<LockHandle>) -> Result<(), LockError> {
    type Release = Pin<Box<dyn Future<Output = Result<(), LockError>> + Send>>;
    let mut pending: Vec<Option<Release>> = handles
        .into_iter()
        .map(|handle| Some(Box::pin(handle.release()) as Release))
        .collect();
    let mut first_error = None;
    std::future::poll_fn(|cx| {
        let mut busy = false;
        for slot in &mut pending {
            if let Some(release) = slot {
                match release.as_mut().poll(cx) {
                    Poll::Ready(result) => {
                        *slot = None;
                        if let (Err(error), None) = (result, &first_error) {
                            first_error = Some(error);
                        }
                    }
                    Poll::Pending => busy = true,
                }
            }
        }
        if busy {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    first_error.map_or(Ok(()), Err)
}

/// Resolves once any of `tokens` is cancelled (at once for an empty list).
async fn any_cancelled(tokens: Vec<CancellationToken>) {
    let mut waits: Vec<_> = tokens
        .into_iter()
        .map(|token| Box::pin(token.cancelled_owned()))
        .collect();
    if waits.is_empty() {
        return;
    }
    std::future::poll_fn(|cx| {
        if waits
            .iter_mut()
            .any(|wait| wait.as_mut().poll(cx).is_ready())
        {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
}

/// The member handles of a hold, until they are released or given up.
type Members = Mutex<Option<Vec<LockHandle>>>;

fn take(members: &Members) -> Option<Vec<LockHandle>> {
    members
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
}

/// Several locks held as one: made by [`DistributedLock::acquire_all`] and
/// [`try_acquire_all`](DistributedLock::try_acquire_all).
///
/// What it tells about the hold — members, mode, fencing tokens, loss signal,
/// [`run`](MultiLockView::run) — is its [`MultiLockView`]'s, reached through `Deref`; the
/// handle adds [`release`](Self::release).
///
/// # Loss
/// The hold is lost when any of its members is lost. Then its
/// [`lost_token`](MultiLockView::lost_token) fires, [`is_held`](MultiLockView::is_held) turns
/// `false`, [`run`](MultiLockView::run) drops its work, and the members still held are released in the
/// background at once: a hold that lost one key has no use for the others, and keeping them
/// would only block their next holders. [`release`](Self::release) on a lost hold waits for
/// those releases to be answered, so code that reports the loss after `release` returns (as
/// the HTTP layer's `500 locking.lost` does) reports it once no other key is still held.
///
/// # Release and drop
/// [`release`](Self::release) releases every member at once and waits for the backend to
/// confirm each; dropping the handle releases them in the background. Either way the lost
/// token fires first.
///
/// # Fencing
/// Each member keeps its own fencing token ([`members`](MultiLockView::members),
/// [`fencing_token`](MultiLockView::fencing_token)): send each resource the token of its own key.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lockingkit::LockError> {
/// use std::time::Duration;
/// let locks = lockingkit::DistributedLock::in_memory();
/// // Whichever order the request names them in, the keys are taken in one order.
/// let both = locks
///     .acquire_all(&["accounts/17", "accounts/4"], Duration::from_secs(5))
///     .await?;
/// let from_token = both.fencing_token("accounts/17");
/// let moved = both.run(async { /* debit 17, credit 4, fenced */ from_token }).await?;
/// both.release().await?;
/// # let _ = moved; Ok(()) }
/// ```
pub struct MultiLockHandle {
    view: MultiLockView,
    members: Arc<Members>,
    /// Fires once the watch has given up the members still held at a loss (their releases
    /// answered), or has ended without having to.
    settled: CancellationToken,
}

impl MultiLockHandle {
    fn new(held: Vec<LockHandle>, mode: LockMode) -> Result<Self, LockError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::new(
                crate::error::ErrorKind::Misconfigured,
                "LockingKit must run inside a tokio runtime",
            )
        })?;
        let views: Arc<[LockView]> = held.iter().map(|handle| handle.view()).collect();
        let tokens = views.iter().map(LockView::lost_token).collect();
        let members = Arc::new(Mutex::new(Some(held)));
        let lost = CancellationToken::new();
        let settled = CancellationToken::new();
        // The watch holds the members weakly, so a dropped handle is never kept alive by it;
        // it ends when any member's token fires, which every member's release does.
        runtime.spawn(watch_members(
            tokens,
            Arc::downgrade(&members),
            lost.clone(),
            settled.clone(),
        ));
        Ok(MultiLockHandle {
            view: MultiLockView {
                members: views,
                mode,
                lost,
            },
            members,
            settled,
        })
    }

    /// A cloneable view of this hold, for code that must watch it without owning it (a
    /// spawned task, a request's extensions). The view never releases; the handle does.
    pub fn view(&self) -> MultiLockView {
        self.view.clone()
    }

    /// Releases every member at once and waits for the backend to confirm each.
    ///
    /// `Ok` if every release was confirmed; otherwise the first member's error. If the hold
    /// had been lost, the error is of kind [`ErrorKind::Lost`], and it returns only once the
    /// releases of the members still held at the loss have been answered (confirmed, refused
    /// or timed out after the lock's release timeout): when it returns, no key of this hold is
    /// still held by it. In every case the hold stops holding. If this future is dropped, the
    /// releases carry on in the background.
    pub async fn release(self) -> Result<(), LockError> {
        self.view.lost.cancel();
        match take(&self.members) {
            Some(handles) => release_all(handles).await,
            None => {
                // Only the watch takes the members other than this call and `Drop`: the hold
                // was lost, and the answer waits for what the watch gave up.
                self.settled.cancelled().await;
                Err(LockError::lost(self.loss_reason()))
            }
        }
    }
}

impl std::ops::Deref for MultiLockHandle {
    type Target = MultiLockView;

    fn deref(&self) -> &MultiLockView {
        &self.view
    }
}

/// A cloneable, read-only view of a multi-key hold: its members (keys and fencing tokens), its
/// mode and its loss signal. Made by [`MultiLockHandle::view`]; like [`LockView`], it answers like the
/// handle but cannot release the hold, and does not keep it alive.
#[derive(Clone)]
pub struct MultiLockView {
    members: Arc<[LockView]>,
    /// Every member's: a multi-key hold takes all its keys in one mode.
    mode: LockMode,
    lost: CancellationToken,
}

impl MultiLockView {
    /// The members, one per distinct key, in the order they were taken (canonical order).
    pub fn members(&self) -> &[LockView] {
        &self.members
    }

    /// How every member is held: the mode the hold was taken in ([`LockMode::Exclusive`]
    /// through [`acquire_all`](DistributedLock::acquire_all), the given one through
    /// [`acquire_all_in`](DistributedLock::acquire_all_in)).
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// The keys held, in canonical order.
    pub fn keys(&self) -> impl Iterator<Item = &str> + '_ {
        self.members.iter().map(LockView::key)
    }

    /// The fencing token of `key`'s lock, if `key` is a member.
    pub fn fencing_token(&self, key: &str) -> Option<u64> {
        self.members
            .iter()
            .find(|view| view.key() == key)
            .map(LockView::fencing_token)
    }

    /// A token that is cancelled when any member is lost, or the hold is released. Each call
    /// returns a child token, so cancelling it affects only your copy.
    pub fn lost_token(&self) -> CancellationToken {
        self.lost.child_token()
    }

    /// Whether every member is still held.
    pub fn is_held(&self) -> bool {
        !self.lost.is_cancelled() && self.members.iter().all(LockView::is_held)
    }

    /// Why a member was lost, once one has been.
    pub fn loss_reason(&self) -> Option<LossReason> {
        self.members.iter().find_map(LockView::loss_reason)
    }

    /// `Ok(())` while every member is held, `Err` of kind [`ErrorKind::Lost`] after.
    pub fn ensure_held(&self) -> Result<(), LockError> {
        if self.is_held() {
            Ok(())
        } else {
            Err(LockError::lost(self.loss_reason()))
        }
    }

    /// Whether this hold was taken through `locks` (or a clone of it).
    pub fn is_from(&self, locks: &DistributedLock) -> bool {
        self.members.iter().all(|member| member.is_from(locks))
    }

    /// Runs `work` while every member is held, dropping it the moment any is lost or the hold
    /// is released; as [`LockView::run`], loss wins a tie.
    pub async fn run<F: Future>(&self, work: F) -> Result<F::Output, LockError> {
        self.ensure_held()?;
        tokio::select! {
            biased;
            _ = self.lost.cancelled() => Err(LockError::lost(self.loss_reason())),
            output = work => Ok(output),
        }
    }
}

impl fmt::Debug for MultiLockView {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The keys are left out on purpose: keys routinely carry customer ids.
        let tokens: Vec<u64> = self.members.iter().map(LockView::fencing_token).collect();
        f.debug_struct("MultiLockView")
            .field("mode", &self.mode)
            .field("fencing_tokens", &tokens)
            .field("is_held", &self.is_held())
            .finish_non_exhaustive()
    }
}

/// Waits for any member to end, then ends the hold: fires its token, releases the members
/// still held and waits for the answers, then fires `settled`.
async fn watch_members(
    tokens: Vec<CancellationToken>,
    members: Weak<Members>,
    lost: CancellationToken,
    settled: CancellationToken,
) {
    // Fires however the watch ends, including dropped unfinished with its runtime, so a
    // `release` waiting on it never hangs.
    let _settled = settled.drop_guard();
    any_cancelled(tokens).await;
    lost.cancel();
    let given_up = members.upgrade().and_then(|members| take(&members));
    if let Some(handles) = given_up {
        // A member already lost answers at once; the others are released for real.
        let _ = release_all(handles).await;
    }
}

impl Drop for MultiLockHandle {
    fn drop(&mut self) {
        self.view.lost.cancel();
        drop(take(&self.members));
    }
}

impl fmt::Debug for MultiLockHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The keys are left out on purpose: keys routinely carry customer ids.
        let tokens: Vec<u64> = self.members().iter().map(LockView::fencing_token).collect();
        f.debug_struct("MultiLockHandle")
            .field("mode", &self.mode())
            .field("fencing_tokens", &tokens)
            .field("is_held", &self.is_held())
            .finish_non_exhaustive()
    }
}
