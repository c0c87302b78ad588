//! The etcd provider: holds are keys attached to an etcd lease (`feature = "etcd"`).
//!
//! A lock of key `k` is a directory of keys (see [`EtcdLockKeys`]): every writer holding or
//! queued for `k` has a key under `w/`, every reader holding it a key under `r/`, each attached
//! to the backend's one etcd lease, which the engine's renewals keep alive. Who holds is decided
//! by *create revisions*, the cluster-wide, durable, strictly increasing counter etcd stamps on
//! every key it creates:
//!
//! - a **writer** (a plain lock) holds when its key is the oldest in the directory and no
//!   reader holds;
//! - a **reader** holds when no writer is older than it (so a queued writer holds new readers
//!   back: writers are not starved);
//! - a **semaphore** of `N` admits the `N` oldest keys of its own directory.
//!
//! Locks are built from transactions — never the `Lock` RPC, which had a safety bug on 3.4
//! (etcd #11456). The first attempt of a caller creates its key only if the directory is empty
//! (for a reader: only if it has no writer), in one transaction; a busy answer writes nothing.
//! A caller that goes on waiting gets a **queue place**: a writer key of its own whose create
//! revision is its place in line, and the lock goes to the oldest place, whichever process it
//! is in (first come, first served across processes, as in etcd's concurrency recipes). A
//! waiter is woken by the backend's one watch stream the moment a key of its lock is deleted,
//! and a place whose wait ends (timed out, dropped) is deleted.
//!
//! The **fencing token** is the create revision of the holder's key: a holder's key is the
//! oldest of its directory, so every later holder's key was created later and has a greater
//! revision. Revisions survive leader changes and restarts of the whole cluster.

mod attempt;
mod errors;
mod layout;
mod lease;
mod options;
mod queue;
mod watch;

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use layout::EtcdLockKeys;
pub use options::{EtcdOptions, DEFAULT_KEY_PREFIX, MAX_LEASE_TTL, MIN_LEASE_TTL};

use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend, LockMode};
use crate::error::LockError;
use crate::MAX_SEMAPHORE_COUNT;
use errors::bounded;
use lease::{LeaseGeneration, SharedLease};
use watch::{Interest, Sink, WatchHub};

/// The provider name in telemetry.
pub(crate) const PROVIDER: &str = "etcd";

/// After a failed connect, no new one starts for this long.
const CONNECT_BACKOFF: Duration = Duration::from_secs(1);

/// The etcd backend: a client of the cluster, the backend's lease, its watch stream and the
/// transactions of the lock protocol.
///
/// ```no_run
/// use lockingkit::{DistributedLock, EtcdBackend, EtcdOptions};
///
/// # async fn run() -> Result<(), lockingkit::LockError> {
/// let backend = EtcdBackend::new(EtcdOptions::new([
///     "http://10.0.0.1:2379",
///     "http://10.0.0.2:2379",
///     "http://10.0.0.3:2379",
/// ]))?;
/// let locks = DistributedLock::builder(backend).name("Jobs").build()?;
/// let handle = locks.try_acquire("jobs/nightly-export").await?;
/// // … work, sending handle.fencing_token() with every write …
/// handle.release().await?;
/// # Ok(()) }
/// ```
///
/// Clones share the client, the lease, the watch stream and the queue places.
#[derive(Clone)]
pub struct EtcdBackend {
    inner: Arc<Inner>,
}

/// What the clones of one [`EtcdBackend`] share.
struct Inner {
    endpoints: Vec<String>,
    connect: ConnectOptions,
    client: tokio::sync::OnceCell<Client>,
    /// No connect starts before this (set after one failed).
    quiet_until: Mutex<Option<Instant>>,
    key_prefix: String,
    ttl: Duration,
    timeout: Duration,
    lease: SharedLease,
    watches: WatchHub,
    queue: queue::Queue,
    strays: attempt::Strays,
}

impl EtcdBackend {
    /// Validates `options` and prepares the client. Nothing is sent until the first attempt,
    /// so a cluster that is down at startup is reported by the attempts, as
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable), not here.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured), listing every
    /// problem, when the options are invalid or a TLS file cannot be read.
    pub fn new(options: EtcdOptions) -> Result<Self, LockError> {
        let section = "EtcdOptions";
        let mut problems = options.problems(section);
        let tls = tls_options(&options, section, &mut problems);
        if !problems.is_empty() {
            return Err(LockError::misconfigured(problems));
        }
        let timeout = options.request_timeout;
        let mut connect = ConnectOptions::new()
            // A member cut off from the quorum fails requests and watches at once instead of
            // serving stale reads or silently never reporting an event.
            .with_require_leader(true)
            .with_connect_timeout(timeout)
            // HTTP/2 pings notice a member that stopped answering; etcd refuses pings more
            // often than every 5 s.
            .with_keep_alive(Duration::from_secs(10), timeout)
            .with_tcp_keepalive(Duration::from_secs(30));
        if let (Some(user), Some(password)) = (&options.user, &options.password) {
            connect = connect.with_user(user.clone(), password.expose().to_owned());
        }
        if let Some(tls) = tls {
            connect = connect.with_tls(tls);
        }
        Ok(EtcdBackend {
            inner: Arc::new(Inner {
                endpoints: options.endpoints.clone(),
                connect,
                client: tokio::sync::OnceCell::new(),
                quiet_until: Mutex::new(None),
                key_prefix: options.key_prefix.clone(),
                ttl: options.lease_ttl,
                timeout,
                lease: SharedLease::new(options.lease_ttl, timeout),
                watches: WatchHub::new(),
                queue: queue::Queue::default(),
                strays: attempt::Strays::default(),
            }),
        })
    }

    /// The id of the backend's etcd lease now, if one is granted: every key this backend
    /// writes is attached to it (`etcdctl lease timetolive --keys`).
    pub fn lease_id(&self) -> Option<i64> {
        self.inner.lease.current_id()
    }

    /// How many of this process's waiters stand in line now, each with a queue place (a key
    /// of its own in etcd).
    pub fn queue_places(&self) -> usize {
        self.inner.queue.watched_places()
    }

    /// How many lease keep-alives the backend has sent: at most one per twentieth of the
    /// lease TTL, however many holds it renews.
    pub fn keep_alives_sent(&self) -> u64 {
        self.inner.lease.keep_alives_sent()
    }

    /// How many keys whose delete went unanswered are being retried in the background.
    pub fn pending_deletes(&self) -> usize {
        self.inner.strays.pending()
    }

    /// How many watches the backend's one watch stream carries now (one per key waited for,
    /// and one per hold renewed at least once).
    pub fn watches(&self) -> usize {
        self.inner.watches.watched()
    }
}

impl Inner {
    /// The client, connected on first use: one connect in flight at a time, and none for a
    /// while after one failed.
    async fn client(&self) -> Result<Client, BackendError> {
        if let Some(client) = self.client.get() {
            return Ok(client.clone());
        }
        let quiet = *self
            .quiet_until
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if quiet.is_some_and(|until| Instant::now() < until) {
            return Err(BackendError::unreachable(
                "the last connection attempt to etcd failed moments ago",
            ));
        }
        let connected = self
            .client
            .get_or_try_init(|| {
                bounded("connection", self.timeout, || {
                    Client::connect(self.endpoints.clone(), Some(self.connect.clone()))
                })
            })
            .await;
        match connected {
            Ok(client) => Ok(client.clone()),
            Err(error) => {
                let until = crate::clock::in_(CONNECT_BACKOFF);
                *self
                    .quiet_until
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(until);
                Err(error)
            }
        }
    }

    /// Watches `key` (exactly) for changes after `created`, ending `ended` on the first.
    fn watch_hold(
        &self,
        client: &Client,
        key: &[u8],
        created: i64,
        ended: &CancellationToken,
    ) -> i64 {
        self.watches.add(
            client,
            Interest {
                key: key.to_vec(),
                range_end: Vec::new(),
                from_revision: created.saturating_add(1),
                sink: Sink::End {
                    ended: ended.clone(),
                    created,
                },
            },
        )
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every clone, lease and hint is gone: nothing of ours should outlive the backend.
        self.lease.revoke_in_background(self.client.get().cloned());
    }
}

/// The TLS settings for `https` endpoints, reading the files the options name.
fn tls_options(
    options: &EtcdOptions,
    section: &str,
    problems: &mut Vec<String>,
) -> Option<TlsOptions> {
    if !options.uses_tls() {
        return None;
    }
    let mut tls = TlsOptions::new().with_native_roots();
    let mut read = |field: &str, path: &std::path::Path| match std::fs::read(path) {
        Ok(bytes) => Some(bytes),
        Err(error) => {
            problems.push(format!("{section}.{field}: cannot read the file ({error})"));
            None
        }
    };
    if let Some(ca) = options
        .tls_ca_file
        .as_deref()
        .and_then(|p| read("tls_ca_file", p))
    {
        tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
    }
    if let (Some(cert), Some(key)) = (&options.tls_cert_file, &options.tls_key_file) {
        if let (Some(cert), Some(key)) = (read("tls_cert_file", cert), read("tls_key_file", key)) {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
    }
    if let Some(domain) = &options.tls_domain {
        tls = tls.domain_name(domain.clone());
    }
    Some(tls)
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("endpoints", &self.inner.endpoints)
            .field("lease_ttl", &self.inner.ttl)
            .field("request_timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl LockBackend for EtcdBackend {
    type Lease = EtcdLease;

    fn provider(&self) -> &str {
        PROVIDER
    }

    fn timing(&self) -> LeaseTiming {
        LeaseTiming::Expiring(self.inner.ttl)
    }

    async fn try_acquire(&self, key: &str) -> Result<Option<Acquired<EtcdLease>>, BackendError> {
        self.inner.attempt(key, LockMode::Exclusive).await
    }

    /// Exclusive and shared locks, and semaphores of 1 to [`MAX_SEMAPHORE_COUNT`] holders.
    fn supports(&self, mode: LockMode) -> bool {
        match mode {
            LockMode::Exclusive | LockMode::Shared => true,
            LockMode::Semaphore { max_count } => (1..=MAX_SEMAPHORE_COUNT).contains(&max_count),
        }
    }

    async fn try_acquire_in(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<EtcdLease>>, BackendError> {
        if let LockMode::Semaphore { max_count } = mode {
            if !(1..=MAX_SEMAPHORE_COUNT).contains(&max_count) {
                return Err(BackendError::misconfigured(format!(
                    "an etcd semaphore has 1 to {MAX_SEMAPHORE_COUNT} holders"
                )));
            }
        }
        self.inner.attempt(key, mode).await
    }

    /// One keep-alive of the backend's lease vouches for every hold on it (see `lease`). A
    /// hold whose key someone else deleted or overwrote is gone, whatever the lease says.
    async fn renew(&self, lease: &EtcdLease) -> Result<(), BackendError> {
        let asked = Instant::now();
        let client = self.inner.client().await?;
        lease.watch_once(&self.inner, &client);
        if lease.ended.is_cancelled() {
            return Err(BackendError::lease_gone(
                "the lock's etcd key was deleted or overwritten by another client",
            ));
        }
        lease.generation.refresh(&client, asked).await
    }

    async fn release(&self, lease: &EtcdLease) -> Result<(), BackendError> {
        self.inner.release(lease).await
    }

    fn release_hint(&self, key: &str) -> impl Future<Output = ()> + Send + 'static {
        self.inner.hint(key)
    }

    /// A hold's key is watched: someone else deleting or overwriting it is loss at once.
    fn watches_leases(&self) -> bool {
        true
    }

    fn lease_ended(&self, lease: &EtcdLease) -> impl Future<Output = ()> + Send {
        if let Some(client) = self.inner.client.get() {
            lease.watch_once(&self.inner, client);
        }
        let ended = lease.ended.clone();
        let gone = lease.generation.gone().clone();
        async move {
            tokio::select! {
                _ = ended.cancelled() => {}
                _ = gone.cancelled() => {}
            }
        }
    }
}

/// A held key: a writer's, a reader's or a semaphore holder's, attached to the backend's lease.
///
/// Dropping a lease that was not released deletes its key in the background.
pub struct EtcdLease {
    key: Vec<u8>,
    /// The key's create revision: the fencing token.
    revision: i64,
    generation: Arc<LeaseGeneration>,
    /// Fires when the watch sees the key deleted or overwritten by someone else.
    ended: CancellationToken,
    /// The hold's watch, once it has one (from its first renewal on).
    watch: Mutex<Option<i64>>,
    watching: AtomicBool,
    released: AtomicBool,
    backend: std::sync::Weak<Inner>,
}

impl EtcdLease {
    /// The etcd key of the hold (under [`EtcdLockKeys::lock_directory`] or
    /// [`EtcdLockKeys::semaphore_directory`]).
    pub fn etcd_key(&self) -> &[u8] {
        &self.key
    }

    /// The id of the etcd lease the key is attached to.
    pub fn lease_id(&self) -> i64 {
        self.generation.id
    }

    /// Registers the hold's watch, once: from the revision after the key's creation, so a
    /// change since then is reported even though the watch starts late.
    fn watch_once(&self, backend: &Inner, client: &Client) {
        if self.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let id = backend.watch_hold(client, &self.key, self.revision, &self.ended);
        *self.watch.lock().unwrap_or_else(PoisonError::into_inner) = Some(id);
    }

    /// Removes the hold's watch, if it has one.
    fn unwatch(&self, backend: &Inner) {
        if let Some(id) = self
            .watch
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            backend.watches.remove(id);
        }
    }
}

impl fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key names the lock: keys never reach logs.
        f.debug_struct("EtcdLease")
            .field("lease_id", &self.generation.id)
            .field("revision", &self.revision)
            .finish_non_exhaustive()
    }
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        let Some(backend) = self.backend.upgrade() else {
            return;
        };
        self.unwatch(&backend);
        if !self.released.load(Ordering::Acquire) {
            backend
                .strays
                .add(&backend, self.key.clone(), self.generation.clone());
        }
    }
}
