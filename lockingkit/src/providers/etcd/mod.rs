//! The etcd provider: holds are keys attached to an etcd lease (`feature = "etcd"`).
//!
//! A lock of key `k` is a directory of keys (see [`EtcdLockKeys`](crate::keys::EtcdLockKeys)): every writer holding or
//! queued for `k` has a key under `w/`, every reader holding or queued for it a key under `r/`,
//! each attached to the backend's one etcd lease, which the engine's renewals keep alive. Who
//! holds is decided by *create revisions*, the cluster-wide, durable, strictly increasing
//! counter etcd stamps on every key it creates:
//!
//! - a **writer** (a plain lock) holds when its key is the oldest in the directory;
//! - a **reader** holds when no writer key is older than it (so a queued writer holds new
//!   readers back, and a queued reader goes before the writers that queued after it: neither
//!   side starves);
//! - a **semaphore** of `N` admits the `N` oldest keys of its own directory.
//!
//! Locks are built from transactions — never the `Lock` RPC, which had a safety bug on 3.4
//! (etcd #11456). The first attempt of a caller creates its key only where it holds at once,
//! in one transaction; a busy answer writes nothing. A caller that goes on waiting gets a
//! **queue place**: a key of its own whose create revision is its place in line, so the lock
//! goes to callers in the order they queued, whichever process they are in (first come, first
//! served across processes, as in etcd's concurrency recipes). A waiter is woken by the
//! backend's one watch stream the moment the key just ahead of its place is deleted, and a
//! place whose wait ends (timed out, dropped) is deleted (see `line`).
//!
//! The **fencing token** is the create revision of the holder's key: a writer's key is the
//! oldest of its directory when it holds, so every later holder's key was created later and
//! has a greater revision. Revisions survive leader changes and restarts of the whole cluster.
//!
//! Each member of the cluster is reached through a client of its own, and a member that fails
//! is left alone for a backoff while requests go to the others (see `members`).

mod attempt;
mod errors;
mod held;
pub(crate) mod keys;
mod layout;
mod lease;
mod line;
mod members;
mod options;
mod provider;
mod strays;
mod wait;
mod watch;

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use etcd_client::{Certificate, ConnectOptions, GetOptions, Identity, TlsOptions};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use options::{EtcdOptions, DEFAULT_KEY_PREFIX, MAX_LEASE_TTL, MIN_LEASE_TTL};
pub(crate) use provider::Etcd;

use crate::backend::MAX_SEMAPHORE_COUNT;
use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend, LockMode};
use crate::config::Problem;
use crate::error::LockError;
use attempt::Found;
use held::HeldKey;
use lease::{LeaseGeneration, SharedLease};
use line::{Leaving, Line, Side, WaitId};
use members::{Members, Resend};
use strays::{Stray, Strays};
use watch::{Interest, Sink, WatchHub};

/// The provider name in telemetry.
pub(crate) const PROVIDER: &str = "etcd";

/// The etcd backend: clients of the cluster's members, the backend's lease, its watch stream
/// and the transactions of the lock protocol.
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
/// locks.verify().await?; // the cluster answers and lets us read and write under the prefix
/// let handle = locks.try_acquire("jobs/nightly-export").await?;
/// // … work, sending handle.fencing_token() with every write …
/// handle.release().await?;
/// # Ok(()) }
/// ```
///
/// Clones share the clients, the lease, the watch stream and the background deletes. Each
/// clone keeps the queue places of its own waiters: give every `DistributedLock` its own clone
/// (as `builder` does by taking it), and one engine's callers never take another's place.
pub struct EtcdBackend {
    inner: Arc<Inner>,
    line: Arc<Line>,
}

/// What the clones of one [`EtcdBackend`] share.
struct Inner {
    endpoints: Vec<String>,
    members: Arc<Members>,
    key_prefix: String,
    ttl: Duration,
    timeout: Duration,
    lease: SharedLease,
    watches: WatchHub,
    strays: Strays,
    /// The lines of the clones, for the keeper of their places' lease.
    lines: Mutex<Vec<Weak<Line>>>,
    /// Set while a task keeps the lease alive for queue places.
    place_keeper: AtomicBool,
    /// Holds (leases) alive now, in every clone.
    holds: AtomicUsize,
    /// Clones neither shut down nor dropped.
    active_clones: AtomicUsize,
    /// Cancelled once the last clone is shut down.
    closed: CancellationToken,
}

impl EtcdBackend {
    /// Validates `options` and prepares a client per member. Nothing is sent until the first
    /// attempt (or [`verify`](LockBackend::verify)), so a cluster that is down at startup is
    /// reported by the attempts, as [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable),
    /// not here.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured), listing every
    /// problem, when the options are invalid or a TLS file cannot be read.
    pub fn new(options: EtcdOptions) -> Result<Self, LockError> {
        Self::open(options)
            .map_err(|problems| crate::config::misconfigured_at("EtcdOptions", problems))
    }

    /// [`new`](Self::new), with the problems as data, for the registry to place in the
    /// section the options came from.
    pub(crate) fn open(options: EtcdOptions) -> Result<Self, Vec<Problem>> {
        let mut problems = options.problems();
        // What the options cannot say alone: TLS files this machine cannot read.
        let tls = tls_options(&options, &mut problems);
        if !problems.is_empty() {
            return Err(problems);
        }
        let timeout = options.request_timeout;
        let members = Arc::new(Members::new(
            &options.endpoints,
            &connect_options(&options, tls),
            timeout,
        ));
        let line = Arc::new(Line::default());
        let inner = Arc::new(Inner {
            endpoints: options.endpoints.clone(),
            watches: WatchHub::new(members.clone()),
            members,
            key_prefix: options.key_prefix.clone(),
            ttl: options.lease_ttl,
            timeout,
            lease: SharedLease::new(options.lease_ttl, timeout),
            strays: Strays::default(),
            lines: Mutex::new(vec![Arc::downgrade(&line)]),
            place_keeper: AtomicBool::new(false),
            holds: AtomicUsize::new(0),
            active_clones: AtomicUsize::new(1),
            closed: CancellationToken::new(),
        });
        Ok(EtcdBackend { inner, line })
    }

    /// The id of the backend's etcd lease now, if one is granted: every key this backend
    /// writes is attached to it. etcdctl prints and takes lease ids in hexadecimal, as the
    /// provider's key names carry it: `etcdctl lease timetolive --keys {id:x}`.
    pub fn lease_id(&self) -> Option<i64> {
        self.inner.lease.current().map(|generation| generation.id)
    }

    /// How many waiters of this process (on every clone of the backend) stand in line now,
    /// each with a queue place (a key of its own in etcd, made or being made).
    pub fn queue_places(&self) -> usize {
        self.inner.places()
    }

    /// How many lease keep-alives the backend has sent: at most one per twentieth of the
    /// lease TTL, however many holds it renews.
    pub fn keep_alives_sent(&self) -> u64 {
        self.inner.lease.keep_alives_sent()
    }

    /// How many keys are waiting for a confirmed delete in the background (releases and
    /// attempts that went unanswered, places whose wait ended while the cluster was out of
    /// reach).
    pub fn pending_deletes(&self) -> usize {
        self.inner.strays.pending()
    }

    /// How many watches the backend's one watch stream carries now (one per queue place with
    /// a key ahead of it, and one per hold).
    pub fn watches(&self) -> usize {
        self.inner.watches.watched()
    }

    /// How many members the backend has a client for (each one HTTP/2 connection once used):
    /// at most the number of endpoints.
    pub fn member_clients(&self) -> usize {
        self.inner.members.clients()
    }

    /// One attempt on `key` in `mode`: through the queue place of this clone's wait for `key`
    /// on that side, if it has one (see `line`), else as a newcomer.
    async fn attempt(
        &self,
        key: &str,
        mode: LockMode,
        wait: Option<u64>,
    ) -> Result<Option<Acquired<EtcdLease>>, BackendError> {
        let inner = &self.inner;
        // A place an ended wait left for the key is deleted first: it would answer "busy".
        self.line.settled(key).await;
        // A lease the server dropped while nothing renewed it is found by the first write on
        // it; the attempt then runs once more on a new lease.
        for _ in 0..2 {
            let generation = inner.lease.fresh(&inner.members).await?;
            let found = match mode {
                LockMode::Exclusive => {
                    let id = WaitId::new(key, Side::Writer);
                    inner
                        .attempt_lock(&self.line, &id, wait, &generation)
                        .await?
                }
                LockMode::Shared => {
                    let id = WaitId::new(key, Side::Reader);
                    inner
                        .attempt_lock(&self.line, &id, wait, &generation)
                        .await?
                }
                LockMode::Semaphore { max_count } => {
                    inner.attempt_slot(key, max_count, &generation).await?
                }
            };
            match found {
                Found::Held(lease) => return inner.acquired(lease).map(Some),
                Found::Busy => return Ok(None),
                Found::LeaseGone => generation.mark_gone(),
            }
        }
        Err(BackendError::transient(
            "etcd dropped the backend's lease twice in one attempt",
        ))
    }
}

impl Clone for EtcdBackend {
    /// Another handle on the same clients, lease and watch stream, with a line of queue places
    /// of its own (see [`EtcdBackend`]).
    fn clone(&self) -> Self {
        let line = Arc::new(Line::default());
        {
            let mut lines = self
                .inner
                .lines
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            lines.retain(|line| line.strong_count() > 0);
            lines.push(Arc::downgrade(&line));
        }
        self.inner.active_clones.fetch_add(1, Ordering::AcqRel);
        EtcdBackend {
            inner: self.inner.clone(),
            line,
        }
    }
}

impl Drop for EtcdBackend {
    fn drop(&mut self) {
        if !self.line.closed.swap(true, Ordering::AcqRel) {
            self.inner.active_clones.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Inner {
    /// Queue places standing in the lines of every clone.
    fn places(&self) -> usize {
        self.lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(Weak::upgrade)
            .map(|line| line.places())
            .sum()
    }

    /// A hold of `key` (created at revision `created` and last written by its holder at
    /// `written`) on `generation`.
    fn lease(
        self: &Arc<Self>,
        key: Vec<u8>,
        (created, written): (i64, i64),
        generation: Arc<LeaseGeneration>,
    ) -> EtcdLease {
        self.holds.fetch_add(1, Ordering::AcqRel);
        EtcdLease {
            held: Arc::new(HeldKey::new(key, created, written)),
            generation,
            watch: Mutex::new(None),
            watching: AtomicBool::new(false),
            release_started: AtomicBool::new(false),
            settled: AtomicBool::new(false),
            backend: Arc::downgrade(self),
            leaving: None,
            places_leaving: Mutex::new(None),
        }
    }

    /// The startup check: the cluster answers and has a leader, and the credentials may read
    /// under the key prefix.
    async fn verify(&self) -> Result<(), BackendError> {
        let status = self
            .members
            .call("status check", Resend::Idempotent, |client| {
                let mut maintenance = client.maintenance_client();
                async move { maintenance.status().await }
            })
            .await?;
        if status.leader() == 0 {
            return Err(BackendError::transient(
                "the etcd cluster answers but has no leader",
            ));
        }
        let prefix = self.key_prefix.as_bytes().to_vec();
        let range = GetOptions::new()
            .with_range(layout::range_end(&prefix))
            .with_count_only();
        self.members
            .call("read check", Resend::Idempotent, |client| {
                let (mut kv, prefix, range) = (client.kv_client(), prefix.clone(), range.clone());
                async move { kv.get(prefix, Some(range)).await }
            })
            .await?;
        Ok(())
    }

    /// Ends what the clone `line` had, and, once nothing of the backend is left in use,
    /// revokes the lease (its keys go at once) and stops the watch stream.
    async fn shut_down(self: &Arc<Self>, line: &Line) {
        if line.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        let last = self.active_clones.fetch_sub(1, Ordering::AcqRel) == 1;
        for place in line.take_all(self) {
            self.delete_place(place).await;
        }
        let deadline = crate::clock::in_(self.timeout.saturating_mul(2));
        // A lease nothing stands on any more goes with everything still on it, strays
        // included; otherwise the strays are given a bounded while.
        let unused = self.holds.load(Ordering::Acquire) == 0 && self.places() == 0;
        if unused {
            if let Err(error) = self.lease.revoke(&self.members).await {
                tracing::debug!(target: "lockingkit", %error, "the etcd lease could not be revoked; its keys go when it expires");
            }
        }
        if !self.strays.settled_by(deadline).await {
            tracing::debug!(target: "lockingkit", pending = self.strays.pending(), "etcd deletes still unconfirmed at shutdown; their keys go when the lease expires");
        }
        if last {
            self.closed.cancel();
            self.watches.stop();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every clone, lease and hint is gone: nothing of ours should outlive the backend.
        let (Some(generation), Ok(runtime)) =
            (self.lease.current(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let members = self.members.clone();
        runtime.spawn(async move {
            let id = generation.id;
            let _ = members
                .call("lease revoke", Resend::Idempotent, |client| {
                    let mut leases = client.lease_client();
                    async move { leases.revoke(id).await }
                })
                .await;
        });
    }
}

/// How the clients connect: leader required, bounded connects, HTTP/2 pings, tokens refreshed
/// when they expire, TLS when configured.
fn connect_options(options: &EtcdOptions, tls: Option<TlsOptions>) -> ConnectOptions {
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
        // A member forgets its tokens when it restarts, and tokens expire
        // (`--auth-token-ttl`, 5 minutes by default): a request refused for its token is
        // authenticated again and sent once more.
        connect = connect
            .with_user(user.clone(), password.expose().to_owned())
            .with_auto_token_refresh(true);
    }
    if let Some(tls) = tls {
        connect = connect.with_tls(tls);
    }
    connect
}

/// The TLS settings for `https` endpoints, reading the files the options name.
fn tls_options(options: &EtcdOptions, problems: &mut Vec<Problem>) -> Option<TlsOptions> {
    if !options.uses_tls() {
        return None;
    }
    let mut tls = TlsOptions::new().with_native_roots();
    let mut read = |field: &str, path: &std::path::Path| match std::fs::read(path) {
        Ok(bytes) => Some(bytes),
        Err(error) => {
            problems.push(Problem::detail(
                field,
                format!("cannot read the file ({error})"),
            ));
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

    /// Exclusive and shared locks, and semaphores of 1 to [`MAX_SEMAPHORE_COUNT`] holders.
    fn supports(&self, mode: LockMode) -> bool {
        mode.with_semaphores_up_to(MAX_SEMAPHORE_COUNT)
    }

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<EtcdLease>>, BackendError> {
        if !self.supports(mode) {
            return Err(BackendError::misconfigured(format!(
                "an etcd semaphore has 1 to {MAX_SEMAPHORE_COUNT} holders"
            )));
        }
        self.attempt(key, mode, None).await
    }

    /// One keep-alive of the backend's lease vouches for every hold on it (see `lease`). A
    /// hold whose key someone else deleted or overwrote is gone, whatever the lease says; a
    /// hold whose watch could not vouch for its key has the key read first (see `held`).
    async fn renew(&self, lease: &EtcdLease) -> Result<(), BackendError> {
        let asked = Instant::now();
        lease.watch_once(&self.inner);
        if lease.held.doubted() && !lease.held.is_ended() {
            lease.held.check(&self.inner.members).await?;
        }
        if lease.held.is_ended() {
            return Err(BackendError::lease_gone(
                "the lock's etcd key was deleted or overwritten by another client",
            ));
        }
        lease.generation.refresh(&self.inner.members, asked).await
    }

    async fn release(&self, lease: &EtcdLease) -> Result<(), BackendError> {
        self.inner.release(lease).await
    }

    fn wait(
        self: Arc<Self>,
        key: &str,
        mode: LockMode,
    ) -> impl crate::backend::Wait<Lease = Self::Lease> + use<> {
        wait::EtcdWait::open(self, key, mode)
    }

    /// A hold's key is watched: someone else deleting or overwriting it is loss at once.
    fn watches_leases(&self) -> bool {
        true
    }

    fn lease_ended(&self, lease: &EtcdLease) -> impl Future<Output = ()> + Send {
        lease.watch_once(&self.inner);
        let ended = lease.held.ended().clone();
        let gone = lease.generation.gone().clone();
        async move {
            tokio::select! {
                _ = ended.cancelled() => {}
                _ = gone.cancelled() => {}
            }
        }
    }

    /// A status request (the cluster answers and has a leader), then a count of the keys
    /// under `key_prefix` (the credentials are accepted and may read there). Takes no lock.
    async fn verify(&self) -> Result<(), BackendError> {
        self.inner.verify().await
    }

    /// Deletes this clone's queue places and, once no clone holds or waits for anything,
    /// revokes the lease and stops the watch stream; unconfirmed deletes get twice the request
    /// timeout to finish.
    async fn shutdown(&self) {
        self.inner.shut_down(&self.line).await;
    }
}

/// A held key: a writer's, a reader's or a semaphore holder's, attached to the backend's lease.
///
/// Dropping a lease whose key was not confirmed deleted deletes it in the background.
pub struct EtcdLease {
    /// The key, its revisions, and whether someone else took it away.
    held: Arc<HeldKey>,
    generation: Arc<LeaseGeneration>,
    /// The hold's watch, once it has one.
    watch: Mutex<Option<i64>>,
    watching: AtomicBool,
    release_started: AtomicBool,
    /// The key's fate is settled: etcd answered its delete, or the delete was handed to the
    /// background deletes.
    settled: AtomicBool,
    backend: Weak<Inner>,
    /// For a hold an ended wait's place became: keeps the clone's attempts for the key waiting
    /// until the hold is released (or dropped), as for the place (see `line`).
    leaving: Option<Leaving>,
    /// Places of the key the hold's wait left, still being deleted when it was won: its release
    /// is answered once they are gone too.
    places_leaving: Mutex<Option<tokio::sync::watch::Receiver<usize>>>,
}

impl EtcdLease {
    /// Has the release wait for `leaving` (see `places_leaving`).
    fn settling_first(self, leaving: Option<tokio::sync::watch::Receiver<usize>>) -> Self {
        *self
            .places_leaving
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = leaving;
        self
    }

    /// Resolves once the places the hold's wait left are deleted (each is one request, or is
    /// handed to the background deletes).
    async fn places_gone(&self) {
        let leaving = self
            .places_leaving
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(mut leaving) = leaving {
            let _ = leaving.wait_for(|count| *count == 0).await;
        }
    }

    /// Keeps `leaving` until the lease is dropped.
    fn keeping(mut self, leaving: Option<Leaving>) -> Self {
        self.leaving = leaving;
        self
    }

    /// The etcd key of the hold (under
    /// [`EtcdLockKeys::lock_directory`](crate::keys::EtcdLockKeys::lock_directory) or
    /// [`EtcdLockKeys::semaphore_directory`](crate::keys::EtcdLockKeys::semaphore_directory)).
    pub fn etcd_key(&self) -> &[u8] {
        &self.held.key
    }

    /// The id of the etcd lease the key is attached to (etcdctl writes it in hexadecimal:
    /// `format!("{id:x}")`).
    pub fn lease_id(&self) -> i64 {
        self.generation.id
    }

    /// Registers the hold's watch, once: from the holder's own write of the key, so a change
    /// since then is reported even though the watch starts late, and history compacted past
    /// it cancels the watch (see `held`).
    fn watch_once(&self, backend: &Inner) {
        if self.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let id = backend.watches.add(Interest {
            key: self.held.key.clone(),
            from_revision: self.held.written,
            sink: Sink::End(self.held.clone()),
        });
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

    /// Whether a release was started before (and marks one started).
    fn release_started(&self) -> bool {
        self.release_started.swap(true, Ordering::AcqRel)
    }

    /// The key's delete is answered or in the background deletes' hands.
    fn settle(&self) {
        self.settled.store(true, Ordering::Release);
    }

    /// The key, to delete in the background.
    fn stray(&self) -> Stray {
        Stray {
            key: self.held.key.clone(),
            generation: self.generation.clone(),
            created: Some(self.held.created),
        }
    }
}

impl fmt::Debug for EtcdLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key names the lock: keys never reach logs.
        f.debug_struct("EtcdLease")
            .field("lease_id", &self.generation.id)
            .field("revision", &self.held.created)
            .finish_non_exhaustive()
    }
}

impl Drop for EtcdLease {
    fn drop(&mut self) {
        let Some(backend) = self.backend.upgrade() else {
            return;
        };
        backend.holds.fetch_sub(1, Ordering::AcqRel);
        self.unwatch(&backend);
        // A release cut short (its caller gave up waiting) or never made: the key may still
        // be there, and the shared lease would keep it.
        if !self.settled.load(Ordering::Acquire) {
            backend.delete_later(self.stray());
        }
    }
}
