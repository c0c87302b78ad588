//! A backend wrapper that counts the releases reaching the backend, lease by lease.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use crate::backend::{Wait, Woken};
use crate::LockMode;

/// Wraps a [`LockBackend`] and counts, for every lease it grants, the releases sent for it.
///
/// The engine promises a backend that `release` is called at most once per lease, and a lease
/// won by an attempt whose caller went away is still released: counting at the backend is the
/// only place where a skipped or doubled release shows, because a leaked lease expires and a
/// second release is refused without any caller noticing. Clones share their counts.
pub struct CountingBackend<B> {
    inner: Arc<B>,
    /// Releases sent, per lease, in the order the leases were granted.
    releases: Arc<Mutex<Vec<usize>>>,
}

impl<B> Clone for CountingBackend<B> {
    fn clone(&self) -> Self {
        CountingBackend {
            inner: self.inner.clone(),
            releases: self.releases.clone(),
        }
    }
}

/// A lease granted through a [`CountingBackend`]: the wrapped backend's lease and its number.
pub struct CountedLease<L> {
    inner: L,
    index: usize,
}

impl<L> CountedLease<L> {
    /// The wrapped backend's lease.
    pub fn inner(&self) -> &L {
        &self.inner
    }
}

impl<B> CountingBackend<B> {
    /// Counts what reaches `inner`.
    pub fn new(inner: B) -> Self {
        CountingBackend {
            inner: Arc::new(inner),
            releases: Arc::default(),
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// How many releases were sent for each lease granted so far, in grant order.
    pub fn releases_per_lease(&self) -> Vec<usize> {
        self.releases
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Starts counting the releases of a lease just granted.
fn counted<L>(releases: &Mutex<Vec<usize>>, acquired: Acquired<L>) -> Acquired<CountedLease<L>> {
    let mut releases = releases.lock().unwrap_or_else(PoisonError::into_inner);
    releases.push(0);
    Acquired {
        lease: CountedLease {
            inner: acquired.lease,
            index: releases.len() - 1,
        },
        fencing_token: acquired.fencing_token,
    }
}

/// The wait of a [`CountingBackend`]: the wrapped backend's, with its leases counted.
struct CountedWait<W> {
    inner: W,
    releases: Arc<Mutex<Vec<usize>>>,
}

impl<W: Wait> Wait for CountedWait<W> {
    type Lease = CountedLease<W::Lease>;

    fn try_acquire(
        &mut self,
    ) -> impl Future<Output = Result<Option<Acquired<Self::Lease>>, BackendError>> + Send + 'static
    {
        let (attempt, releases) = (self.inner.try_acquire(), self.releases.clone());
        async move { Ok(attempt.await?.map(|acquired| counted(&releases, acquired))) }
    }

    fn changed(&mut self) -> impl Future<Output = Woken<Self::Lease>> + Send + '_ {
        let releases = self.releases.clone();
        async move {
            match self.inner.changed().await {
                Woken::Granted { acquired, sent } => Woken::Granted {
                    acquired: counted(&releases, acquired),
                    sent,
                },
                _ => Woken::Retry,
            }
        }
    }
}

impl<B: LockBackend> LockBackend for CountingBackend<B> {
    type Lease = CountedLease<B::Lease>;

    fn provider(&self) -> &str {
        self.inner.provider()
    }

    fn timing(&self) -> LeaseTiming {
        self.inner.timing()
    }

    fn supports(&self, mode: LockMode) -> bool {
        self.inner.supports(mode)
    }

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<Self::Lease>>, BackendError> {
        let acquired = self.inner.try_acquire(key, mode).await?;
        Ok(acquired.map(|acquired| counted(&self.releases, acquired)))
    }

    async fn renew(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.inner.renew(&lease.inner).await
    }

    async fn release(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        // Counted when sent, not when answered: a release that never answers still went out.
        if let Some(count) = self
            .releases
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_mut(lease.index)
        {
            *count += 1;
        }
        self.inner.release(&lease.inner).await
    }

    /// The wrapped backend's wait, whose leases are counted like the attempts'.
    fn wait(self: Arc<Self>, key: &str, mode: LockMode) -> impl Wait<Lease = Self::Lease> + use<B> {
        CountedWait {
            inner: self.inner.clone().wait(key, mode),
            releases: self.releases.clone(),
        }
    }

    fn lease_ended(&self, lease: &Self::Lease) -> impl Future<Output = ()> + Send {
        self.inner.lease_ended(&lease.inner)
    }
}
