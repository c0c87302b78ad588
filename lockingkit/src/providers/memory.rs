//! The in-memory provider: a real lease backend that lives in this process.
//!
//! Leases expire on tokio's clock unless renewed, fencing tokens grow, and a key is free again
//! once its holder releases or stops renewing, exactly as with Azure Blob leases. Several
//! [`DistributedLock`](crate::DistributedLock)s built on one [`MemoryStore`] behave like
//! separate processes sharing a backend, and the store's fault controls let a test break a
//! lease, fail or hang renewals, or take the backend down.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use serde::{Deserialize, Serialize};

use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend, LockMode};
use crate::config::Problem;
use crate::engine::LockOptions;
use crate::registry::{HostResources, LockingBuilder, Provider};

/// The default in-memory lease, as for Azure.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(30);

mod fault {
    /// What renewals do, for tests of loss handling (with the `testing` feature).
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
    #[non_exhaustive]
    #[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
    pub enum RenewalFault {
        /// Renewals work.
        #[default]
        None,
        /// Renewals fail with a transient error (the lease runs out at its deadline).
        Fail,
        /// Renewals never answer (the deadline timer must declare loss).
        Hang,
    }
}

#[cfg(feature = "testing")]
pub use fault::RenewalFault;
#[cfg(not(feature = "testing"))]
use fault::RenewalFault;

/// A shared in-memory lock store. Cloning shares it.
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    leases: Mutex<HashMap<Arc<str>, StoredLease>>,
    /// Readers of keys, and writers waiting for them. Exclusive leases stay in `leases`, so a
    /// plain lock pays one more lookup in a map that is empty unless readers are about.
    readers: Mutex<HashMap<Arc<str>, Readers>>,
    /// How many keys `readers` has: while it is 0, a plain lock skips that map (benchmark row 3,
    /// in-memory pairs, measured 3–7% faster with it). Raised under the `leases` lock as a key's
    /// first reader is added, so a writer holding that lock never misses a reader; lowered
    /// whenever an entry goes.
    read_keys: AtomicUsize,
    /// Semaphores by key, one entry per slot: a namespace apart from the locks.
    semaphores: Mutex<HashMap<Arc<str>, Vec<Option<StoredLease>>>>,
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

impl StoredLease {
    fn live(&self, now: Instant) -> bool {
        self.expires_at > now
    }
}

/// The shared holders of one key, and the intent of a writer waiting for them.
#[derive(Debug, Default)]
struct Readers {
    leases: Vec<StoredLease>,
    /// New readers are refused until then: a writer found the key read and waits.
    writer_waits_until: Option<Instant>,
}

impl Readers {
    fn any_live(&self, now: Instant) -> bool {
        self.leases.iter().any(|lease| lease.live(now))
    }
}

/// How long a writer's intent holds new readers back after its latest attempt. A waiting
/// writer retries at least once a `max_retry_delay` (1 s by default), so with a
/// `max_retry_delay` shorter than this the intent stands for as long as it waits, and lapses
/// soon after it stops. A test double, the in-memory provider takes any `max_retry_delay`; one
/// of 2 s or more lets new readers in between a waiting writer's attempts. (Redis, whose intent
/// is a setting, states it through
/// [`LockBackend::writer_intent`], and the engine holds it
/// to that rule.)
pub const WRITER_INTENT: Duration = Duration::from_secs(2);

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    // Every update of these maps leaves them consistent, so a poisoned lock is still usable.
    // When both lock maps are needed, `leases` is locked first.
    fn leases(&self) -> MutexGuard<'_, HashMap<Arc<str>, StoredLease>> {
        self.inner
            .leases
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn readers(&self) -> MutexGuard<'_, HashMap<Arc<str>, Readers>> {
        self.inner
            .readers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn semaphores(&self) -> MutexGuard<'_, HashMap<Arc<str>, Vec<Option<StoredLease>>>> {
        self.inner
            .semaphores
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `key` has an unexpired lease, exclusive or shared.
    pub fn is_locked(&self, key: &str) -> bool {
        let now = Instant::now();
        self.leases().get(key).is_some_and(|e| e.live(now))
            || self.readers().get(key).is_some_and(|r| r.any_live(now))
    }

    /// How many keys have an unexpired lease, exclusive or shared.
    pub fn locked_count(&self) -> usize {
        let now = Instant::now();
        let exclusive = self.leases().values().filter(|e| e.live(now)).count();
        let shared = self.readers().values().filter(|r| r.any_live(now)).count();
        exclusive + shared
    }

    /// How many unexpired shared leases `key` has.
    pub fn readers_of(&self, key: &str) -> usize {
        let now = Instant::now();
        self.readers()
            .get(key)
            .map_or(0, |r| r.leases.iter().filter(|l| l.live(now)).count())
    }

    /// How many slots of the semaphore `key` have an unexpired lease.
    pub fn semaphore_holders(&self, key: &str) -> usize {
        let now = Instant::now();
        self.semaphores().get(key).map_or(0, |slots| {
            slots.iter().flatten().filter(|l| l.live(now)).count()
        })
    }

    /// Removes the stored lease of `lease`, if it is still this lease's.
    fn remove_stored(&self, lease: &MemoryLease) -> Option<StoredLease> {
        let id = lease.id;
        match lease.held {
            Held::Exclusive => {
                let mut leases = self.leases();
                let ours = leases.get(&*lease.key).is_some_and(|e| e.lease_id == id);
                if ours {
                    leases.remove(&*lease.key)
                } else {
                    None
                }
            }
            Held::Shared => {
                let mut readers = self.readers();
                let entry = readers.get_mut(&*lease.key)?;
                let at = entry.leases.iter().position(|l| l.lease_id == id)?;
                let removed = entry.leases.swap_remove(at);
                if entry.leases.is_empty() && entry.writer_waits_until.is_none() {
                    readers.remove(&*lease.key);
                    self.inner.read_keys.fetch_sub(1, Ordering::AcqRel);
                }
                Some(removed)
            }
            Held::Slot(slot) => {
                let mut semaphores = self.semaphores();
                let slots = semaphores.get_mut(&*lease.key)?;
                let place = slots.get_mut(slot)?;
                if place.as_ref().is_some_and(|l| l.lease_id == id) {
                    let removed = place.take();
                    if slots.iter().all(Option::is_none) {
                        semaphores.remove(&*lease.key);
                    }
                    removed
                } else {
                    None
                }
            }
        }
    }

    /// Breaks the lease on `key`, as another client breaking an Azure lease would: the holder's
    /// next renewal is told the lease is gone. Shared leases of the key are broken too. Returns
    /// whether there was a lease to break.
    pub fn break_lease(&self, key: &str) -> bool {
        let exclusive = self.leases().remove(key).is_some();
        let shared = self.readers().remove(key).is_some();
        if shared {
            self.inner.read_keys.fetch_sub(1, Ordering::AcqRel);
        }
        exclusive || shared
    }

    /// Breaks one holder's lease, as its running out would: that holder's next renewal is told
    /// the lease is gone, and the key's other holders (readers of it, or holders of the
    /// semaphore's other slots) keep theirs. Returns whether the lease was still held.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lockingkit::LockError> {
    /// use lockingkit::providers::memory::MemoryLease;
    /// use lockingkit::{DistributedLock, MemoryStore};
    ///
    /// let store = MemoryStore::new();
    /// let locks = DistributedLock::in_memory_shared(&store);
    /// let first = locks.reader_writer("report")?.try_read().await?;
    /// let second = locks.reader_writer("report")?.try_read().await?;
    /// assert!(first.lease::<MemoryLease>().is_some_and(|lease| store.break_lease_of(lease)));
    /// assert_eq!(store.readers_of("report"), 1); // the second reader's lease stands
    /// # drop(second);
    /// # Ok(()) }
    /// ```
    pub fn break_lease_of(&self, lease: &MemoryLease) -> bool {
        self.remove_stored(lease).is_some()
    }

    /// Breaks the lease on one slot of the semaphore `key`; returns whether it was held.
    pub fn break_semaphore_slot(&self, key: &str, slot: usize) -> bool {
        self.semaphores()
            .get_mut(key)
            .and_then(|slots| slots.get_mut(slot))
            .and_then(Option::take)
            .is_some()
    }

    /// Makes renewals work, fail or hang from now on (with the `testing` feature).
    #[cfg(feature = "testing")]
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

/// Options of the in-memory provider (`provider = "in_memory"` in a configuration section).
///
/// Each in-memory provider built from configuration has its own store, so it only excludes
/// callers in this process: use it for tests and local development, not to coordinate
/// several instances of a service.
///
/// Change the defaults with the `with_*` setters; the struct is `#[non_exhaustive]`, so a later
/// release can add a setting without breaking you.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct MemoryOptions {
    /// How long a lease lasts unless renewed (30 s by default, as for Azure).
    #[serde(with = "crate::config::duration")]
    pub lease_duration: Duration,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        MemoryOptions {
            lease_duration: DEFAULT_LEASE,
        }
    }
}

impl MemoryOptions {
    /// Sets [`lease_duration`](Self::lease_duration), how long a lease lasts unless renewed
    /// (at least 1 ms). Default 30 s.
    pub fn with_lease_duration(mut self, lease_duration: Duration) -> Self {
        self.lease_duration = lease_duration;
        self
    }

    /// Lists every problem with these options, each about one of their settings.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.lease_duration < Duration::from_millis(1) {
            problems.push(Problem::new("lease_duration", "must be at least 1ms"));
        }
        problems
    }
}

/// The in-memory [`LockBackend`].
#[derive(Clone, Debug)]
pub struct MemoryBackend {
    store: MemoryStore,
    lease: Duration,
}

/// A lease granted by the in-memory store. A clone names the same lease (to break it with
/// [`MemoryStore::break_lease_of`]); it holds nothing of its own.
#[derive(Clone, Debug)]
pub struct MemoryLease {
    key: Arc<str>,
    id: u64,
    held: Held,
}

/// Which map a lease lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    Exclusive,
    Shared,
    Slot(usize),
}

impl MemoryLease {
    /// The slot of a semaphore lease; `None` for a lock.
    pub fn slot(&self) -> Option<usize> {
        match self.held {
            Held::Slot(slot) => Some(slot),
            _ => None,
        }
    }
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

    fn new_lease(&self, now: Instant) -> StoredLease {
        StoredLease {
            lease_id: self.store.inner.next_lease.fetch_add(1, Ordering::Relaxed),
            expires_at: crate::clock::after(now, self.lease),
        }
    }

    fn next_token(&self) -> u64 {
        self.store.inner.next_token.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether live readers hold `key`; if so, a writer now waits for them, and its intent
    /// holds new readers back (see [`WRITER_INTENT`]).
    fn read_by_others(&self, key: &str, now: Instant) -> bool {
        if self.store.inner.read_keys.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut readers = self.store.readers();
        let Some(entry) = readers.get_mut(key) else {
            return false;
        };
        entry.leases.retain(|lease| lease.live(now));
        if entry.leases.is_empty() {
            readers.remove(key);
            self.store.inner.read_keys.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        entry.writer_waits_until = Some(crate::clock::after(now, WRITER_INTENT));
        true
    }

    /// One attempt at the plain (exclusive) lock of `key`.
    fn try_lock(&self, key: &str) -> Result<Option<Acquired<MemoryLease>>, BackendError> {
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
            Some((_, current)) if current.live(now) => return Ok(None),
            _ if self.read_by_others(key, now) => return Ok(None),
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
            lease: MemoryLease {
                key,
                id: lease_id,
                held: Held::Exclusive,
            },
            fencing_token,
        }))
    }

    fn try_read(&self, key: &str) -> Result<Option<Acquired<MemoryLease>>, BackendError> {
        let store = &self.store;
        store.inner.attempts.fetch_add(1, Ordering::Relaxed);
        if store.is_unavailable() {
            return Err(Self::unreachable());
        }
        let now = Instant::now();
        let leases = store.leases();
        if leases.get(key).is_some_and(|e| e.live(now)) {
            return Ok(None);
        }
        let mut readers = store.readers();
        let (key, entry) = match readers.get_key_value(key) {
            Some((existing, _)) => {
                let existing = existing.clone();
                let entry = readers.entry(existing.clone()).or_default();
                (existing, entry)
            }
            None => {
                let key: Arc<str> = Arc::from(key);
                store.inner.read_keys.fetch_add(1, Ordering::AcqRel);
                (key.clone(), readers.entry(key).or_default())
            }
        };
        if entry.writer_waits_until.is_some_and(|until| until > now) {
            return Ok(None);
        }
        entry.writer_waits_until = None;
        let stored = self.new_lease(now);
        let id = stored.lease_id;
        entry.leases.push(stored);
        let fencing_token = self.next_token();
        drop(readers);
        drop(leases);
        Ok(Some(Acquired {
            lease: MemoryLease {
                key,
                id,
                held: Held::Shared,
            },
            fencing_token,
        }))
    }

    fn try_take_slot(
        &self,
        key: &str,
        max_count: u32,
    ) -> Result<Option<Acquired<MemoryLease>>, BackendError> {
        let store = &self.store;
        store.inner.attempts.fetch_add(1, Ordering::Relaxed);
        if store.is_unavailable() {
            return Err(Self::unreachable());
        }
        let count = usize::try_from(max_count).unwrap_or(usize::MAX);
        let now = Instant::now();
        let mut semaphores = store.semaphores();
        let key: Arc<str> = match semaphores.get_key_value(key) {
            Some((existing, _)) => existing.clone(),
            None => Arc::from(key),
        };
        let slots = semaphores.entry(key.clone()).or_default();
        // Slots beyond this caller's count (another process configured more) are not its to
        // take, but their holders still count against it.
        let held = slots.iter().flatten().filter(|l| l.live(now)).count();
        if held >= count {
            return Ok(None);
        }
        if slots.len() < count {
            slots.resize_with(count, || None);
        }
        let Some(slot) = slots
            .iter()
            .take(count)
            .position(|s| s.as_ref().is_none_or(|l| !l.live(now)))
        else {
            return Ok(None);
        };
        let stored = self.new_lease(now);
        let id = stored.lease_id;
        if let Some(place) = slots.get_mut(slot) {
            *place = Some(stored);
        }
        let fencing_token = self.next_token();
        drop(semaphores);
        Ok(Some(Acquired {
            lease: MemoryLease {
                key,
                id,
                held: Held::Slot(slot),
            },
            fencing_token,
        }))
    }

    /// Runs `f` on the stored lease of `lease`, if it is still this lease's.
    fn with_stored<T>(
        &self,
        lease: &MemoryLease,
        f: impl FnOnce(&mut StoredLease) -> T,
    ) -> Option<T> {
        let id = lease.id;
        match lease.held {
            Held::Exclusive => self
                .store
                .leases()
                .get_mut(&*lease.key)
                .filter(|e| e.lease_id == id)
                .map(f),
            Held::Shared => self
                .store
                .readers()
                .get_mut(&*lease.key)
                .and_then(|r| r.leases.iter_mut().find(|l| l.lease_id == id))
                .map(f),
            Held::Slot(slot) => self
                .store
                .semaphores()
                .get_mut(&*lease.key)
                .and_then(|slots| slots.get_mut(slot))
                .and_then(Option::as_mut)
                .filter(|l| l.lease_id == id)
                .map(f),
        }
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

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<MemoryLease>>, BackendError> {
        match mode {
            LockMode::Shared => self.try_read(key),
            LockMode::Semaphore { max_count } => self.try_take_slot(key, max_count),
            _ => self.try_lock(key),
        }
    }

    fn supports(&self, mode: LockMode) -> bool {
        matches!(
            mode,
            LockMode::Exclusive | LockMode::Shared | LockMode::Semaphore { .. }
        )
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
        let renewed = self.with_stored(lease, |entry| {
            if entry.live(now) {
                entry.expires_at = crate::clock::after(now, self.lease);
                true
            } else {
                false
            }
        });
        match renewed {
            Some(true) => Ok(()),
            _ => Err(BackendError::lease_gone("the lease expired or was broken")),
        }
    }

    async fn release(&self, lease: &MemoryLease) -> Result<(), BackendError> {
        let store = &self.store;
        if store.is_unavailable() {
            return Err(Self::unreachable());
        }
        let now = Instant::now();
        match self.store.remove_stored(lease) {
            Some(entry) if entry.live(now) => Ok(()),
            Some(_) => Err(BackendError::lease_gone("the lease had expired")),
            None => Err(BackendError::lease_gone("the lease expired or was broken")),
        }
    }
}

/// The in-memory provider as a registry builds it (`provider = "in_memory"`): each registered
/// provider gets a store of its own.
pub(crate) struct InMemory;

impl Provider for InMemory {
    const NAME: &'static str = "in_memory";
    type Options = MemoryOptions;
    type Backend = MemoryBackend;

    fn problems(options: &MemoryOptions) -> Vec<Problem> {
        options.problems()
    }

    fn open(options: MemoryOptions, _: HostResources<'_>) -> Result<MemoryBackend, Vec<Problem>> {
        let problems = options.problems();
        if !problems.is_empty() {
            return Err(problems);
        }
        Ok(MemoryBackend::with_lease(
            MemoryStore::new(),
            options.lease_duration,
        ))
    }
}

impl LockingBuilder {
    /// Adds an in-memory provider with its own store, default options and 30 s leases.
    pub fn in_memory(self, name: impl Into<String>) -> Self {
        self.built_in::<InMemory>(name, MemoryOptions::default(), LockOptions::default())
    }
}
