//! The in-memory provider: a real lease backend that lives in this process.
//!
//! Leases expire on tokio's clock unless renewed, fencing tokens grow, and a key is free again
//! once its holder releases or stops renewing, exactly as with Azure Blob leases. Several
//! [`DistributedLock`](crate::DistributedLock)s built on one [`MemoryStore`] behave like
//! separate processes sharing a backend, and the store's fault controls let a test break a
//! lease, fail or hang renewals, or take the backend down.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend};

/// The default in-memory lease, as for Azure.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// What renewals do, for tests of loss handling.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum RenewalFault {
    /// Renewals work.
    #[default]
    None,
    /// Renewals fail with a transient error (the lease runs out at its deadline).
    Fail,
    /// Renewals never answer (the deadline timer must declare loss).
    Hang,
}

/// A shared in-memory lock store. Cloning shares it.
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    leases: Mutex<HashMap<Arc<str>, StoredLease>>,
    next_token: AtomicU64,
    next_lease: AtomicU64,
    attempts: AtomicU64,
    renewals: AtomicU64,
    renewal_fault: AtomicU8,
    unavailable: AtomicBool,
}

#[derive(Debug)]
struct StoredLease {
    lease_id: u64,
    expires_at: Instant,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn leases(&self) -> MutexGuard<'_, HashMap<Arc<str>, StoredLease>> {
        // Every update leaves the map consistent, so a poisoned lock is still usable.
        self.inner
            .leases
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `key` has an unexpired lease.
    pub fn is_locked(&self, key: &str) -> bool {
        let now = Instant::now();
        self.leases().get(key).is_some_and(|e| e.expires_at > now)
    }

    /// How many keys have an unexpired lease.
    pub fn locked_count(&self) -> usize {
        let now = Instant::now();
        self.leases()
            .values()
            .filter(|e| e.expires_at > now)
            .count()
    }

    /// Breaks the lease on `key`, as another client breaking an Azure lease would: the holder's
    /// next renewal is told the lease is gone. Returns whether there was a lease to break.
    pub fn break_lease(&self, key: &str) -> bool {
        self.leases().remove(key).is_some()
    }

    /// Makes renewals work, fail or hang from now on.
    pub fn set_renewal_fault(&self, fault: RenewalFault) {
        let value = match fault {
            RenewalFault::None => 0,
            RenewalFault::Fail => 1,
            RenewalFault::Hang => 2,
        };
        self.inner.renewal_fault.store(value, Ordering::Release);
    }

    fn renewal_fault(&self) -> RenewalFault {
        match self.inner.renewal_fault.load(Ordering::Acquire) {
            1 => RenewalFault::Fail,
            2 => RenewalFault::Hang,
            _ => RenewalFault::None,
        }
    }

    /// Takes the backend down (every request fails as unreachable) or brings it back.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.inner.unavailable.store(unavailable, Ordering::Release);
    }

    fn is_unavailable(&self) -> bool {
        self.inner.unavailable.load(Ordering::Acquire)
    }

    /// How many acquire attempts reached this store.
    pub fn attempts(&self) -> u64 {
        self.inner.attempts.load(Ordering::Relaxed)
    }

    /// How many renewals reached this store.
    pub fn renewals(&self) -> u64 {
        self.inner.renewals.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("locked", &self.locked_count())
            .finish_non_exhaustive()
    }
}

/// The in-memory [`LockBackend`].
#[derive(Clone, Debug)]
pub struct MemoryBackend {
    store: MemoryStore,
    lease: Duration,
}

/// A lease granted by the in-memory store.
#[derive(Debug)]
pub struct MemoryLease {
    key: Arc<str>,
    id: u64,
}

impl MemoryBackend {
    /// A backend on `store` with the default 30 s lease.
    pub fn new(store: MemoryStore) -> Self {
        Self::with_lease(store, DEFAULT_LEASE)
    }

    /// A backend on `store` with leases of `lease`.
    pub fn with_lease(store: MemoryStore, lease: Duration) -> Self {
        MemoryBackend { store, lease }
    }

    /// The store this backend uses, for its fault controls.
    pub fn store(&self) -> &MemoryStore {
        &self.store
    }

    fn unreachable() -> BackendError {
        BackendError::unreachable("the in-memory store is switched to unavailable")
    }
}

impl LockBackend for MemoryBackend {
    type Lease = MemoryLease;

    fn provider(&self) -> &str {
        "in_memory"
    }

    fn timing(&self) -> LeaseTiming {
        LeaseTiming::Expiring(self.lease)
    }

    async fn try_acquire(&self, key: &str) -> Result<Option<Acquired<MemoryLease>>, BackendError> {
        let store = &self.store;
        store.inner.attempts.fetch_add(1, Ordering::Relaxed);
        if store.is_unavailable() {
            return Err(Self::unreachable());
        }
        let now = Instant::now();
        let mut leases = store.leases();
        let lease_id = store.inner.next_lease.fetch_add(1, Ordering::Relaxed);
        let entry = StoredLease {
            lease_id,
            expires_at: crate::clock::after(now, self.lease),
        };
        let key = match leases.get_key_value(key) {
            Some((_, current)) if current.expires_at > now => return Ok(None),
            Some((existing, _expired)) => {
                let existing = existing.clone();
                leases.insert(existing.clone(), entry);
                existing
            }
            None => {
                let key: Arc<str> = Arc::from(key);
                leases.insert(key.clone(), entry);
                key
            }
        };
        // Taken under the map lock, so tokens are handed out in acquisition order.
        let fencing_token = store.inner.next_token.fetch_add(1, Ordering::Relaxed) + 1;
        drop(leases);
        Ok(Some(Acquired {
            lease: MemoryLease { key, id: lease_id },
            fencing_token,
        }))
    }

    async fn renew(&self, lease: &MemoryLease) -> Result<(), BackendError> {
        let store = &self.store;
        store.inner.renewals.fetch_add(1, Ordering::Relaxed);
        if store.is_unavailable() {
            return Err(Self::unreachable());
        }
        match store.renewal_fault() {
            RenewalFault::None => {}
            RenewalFault::Fail => {
                return Err(BackendError::transient("renewal failed (injected fault)"))
            }
            RenewalFault::Hang => std::future::pending::<()>().await,
        }
        let now = Instant::now();
        match store.leases().get_mut(&*lease.key) {
            Some(entry) if entry.lease_id == lease.id && entry.expires_at > now => {
                entry.expires_at = crate::clock::after(now, self.lease);
                Ok(())
            }
            _ => Err(BackendError::lease_gone("the lease expired or was broken")),
        }
    }

    async fn release(&self, lease: &MemoryLease) -> Result<(), BackendError> {
        let store = &self.store;
        if store.is_unavailable() {
            return Err(Self::unreachable());
        }
        let now = Instant::now();
        let mut leases = store.leases();
        match leases.get(&*lease.key) {
            Some(entry) if entry.lease_id == lease.id => {
                let expired = entry.expires_at <= now;
                leases.remove(&*lease.key);
                if expired {
                    Err(BackendError::lease_gone("the lease had expired"))
                } else {
                    Ok(())
                }
            }
            _ => Err(BackendError::lease_gone("the lease expired or was broken")),
        }
    }
}
