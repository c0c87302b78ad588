//! The Redis provider (`feature = "redis"`): expiring leases on a Redis server or a Redis
//! Cluster, through the `redis` crate.
//!
//! A lock is a string set if absent with the lease as its expiry and a random holder id as its
//! value; renewing compares the value and extends the expiry, releasing compares and deletes
//! (and publishes, so waiters in other processes wake at once). Readers and semaphore holders
//! are members of sorted sets, scored by their expiry. Each step is one Lua script over the
//! names of one key, which share a hash slot (see [`RedisLockKeys`]), so each is one round trip
//! and works on Redis Cluster. The scripts and the fencing rule are described in the Redis
//! guide (`docs/redis.md`).
//!
//! # Guarantees and caveats
//! - **Leases expire on the server**: the engine renews them every third of the lease and
//!   declares loss at 90% of the lease after the last successful renewal was *sent*, before
//!   Redis could hand the key to anyone else. A renewal that finds the key gone or held by
//!   another holder id is loss at once (`LeaseGone`): the key expired, was deleted
//!   (`DEL`, `FLUSHALL`) or overwritten. A renewal that cannot reach Redis is retried until the
//!   deadline: the lease lives on the server meanwhile.
//! - **Fencing tokens** are minted in the acquire script: `max(last + 1, server clock in µs)`,
//!   so they keep growing across a restart without persistence and a failover, as long as the
//!   server's clock did not go back (see the guide).
//! - **One connection for every lock** of a backend (to a server; on a cluster, one to each
//!   node the cluster client knows), multiplexed, reconnected with backoff; plus one pub/sub
//!   connection per backend while it has waiters for keys held elsewhere. Every request has its
//!   own timeout ([`request_timeout`](RedisOptions::request_timeout)).
//! - **Redis must not evict the lock keys**: run them with `maxmemory-policy noeviction` (the
//!   default) or on an instance whose memory never fills; [`RedisBackend::verify`] warns about
//!   any other policy it can read.
//! - **Replication is asynchronous**: a failover can promote a replica that had not received a
//!   lock, and the holder learns of it only at its next renewal, while another process may
//!   already have taken the key. [`replicas`](RedisOptions::replicas) (`WAIT`) narrows that
//!   window; it cannot close it. Fencing tokens are what protects the resource there.
//! - **An attempt that got no answer may still have taken the lock** (the request may have run
//!   after the timeout): a compare-and-delete of its holder id follows it, usually on the same
//!   connection (on a new one if that one broke), so the key is not kept until its lease runs
//!   out.

mod check;
mod connection;
mod errors;
mod eval;
pub(crate) mod keys;
pub mod lua;
mod node;
mod options;
mod provider;
mod tls;
mod wait;
mod watch;

use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use options::{RedisOptions, MAX_KEY_PREFIX_LEN, MAX_LEASE_DURATION, MIN_LEASE_DURATION};
pub(crate) use provider::Redis;

use crate::backend::MAX_SEMAPHORE_COUNT;
use crate::backend::{
    Acquired, BackendError, BackendErrorKind, LeaseTiming, LockBackend, LockMode,
};
use crate::config::Problem;
use crate::error::LockError;
use crate::health::{Health, OUTAGE_FIRST, OUTAGE_MOST};
use connection::{Connection, Target};
use errors::Stage;
use eval::{Answer, Replication, Script, Scripts};
use keys::{RedisLockKeys, RedisLockNames, RedisSemaphoreNames};
use watch::ReleaseWatch;

/// The provider name in telemetry.
pub(crate) const PROVIDER: &str = "redis";

/// The section name used in errors when options are checked outside a registry.
const SECTION: &str = "RedisOptions";

/// Locks on Redis: a [`LockBackend`] for [`DistributedLock::builder`](crate::DistributedLock::builder).
///
/// ```no_run
/// use lockingkit::{DistributedLock, RedisBackend, RedisOptions};
///
/// # async fn run() -> Result<(), lockingkit::LockError> {
/// let backend = RedisBackend::new(RedisOptions::new("redis://:secret@cache.internal:6379/0"))?;
/// backend.verify().await?; // reachable, credentials accepted, scripts allowed
/// let locks = DistributedLock::builder(backend).name("Jobs").build()?;
/// let handle = locks.try_acquire("jobs/nightly-export").await?;
/// // … work, sending handle.fencing_token() with every write …
/// handle.release().await?;
/// # Ok(()) }
/// ```
///
/// Clones share the connections and the release watch: two `DistributedLock`s built from
/// clones of one backend use one connection budget.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Backend>,
}

/// What the clones of one [`RedisBackend`] share.
struct Backend {
    connection: Connection,
    scripts: &'static Scripts,
    releases: ReleaseWatch,
    prefix: String,
    lease: Duration,
    timeout: Duration,
    lease_ms: String,
    intent_ms: String,
    /// `writer_intent`, which the engine checks against its `max_retry_delay`.
    intent: Duration,
    replication: Option<Replication>,
    holders: HolderIds,
}

impl RedisBackend {
    /// Validates `options`. No connection is opened until the first request, so a server that
    /// is down at startup is reported by the attempts, as
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable), or by
    /// [`verify`](Self::verify).
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured), listing every
    /// problem, when the options are invalid.
    pub fn new(options: RedisOptions) -> Result<Self, LockError> {
        Self::open(options).map_err(|problems| crate::config::misconfigured_at(SECTION, problems))
    }

    /// [`new`](Self::new), with the problems as data, for the registry to place in the
    /// section the options came from.
    pub(crate) fn open(options: RedisOptions) -> Result<Self, Vec<Problem>> {
        let problems = options.problems();
        if !problems.is_empty() {
            return Err(problems);
        }
        // What the options cannot say alone: TLS settings this machine cannot honour.
        let tls = match Target::uses_tls(&options) {
            true => Some(
                tls::client_config(options.tls_root_cert.as_deref())
                    .map_err(|problem| vec![problem])?,
            ),
            false => None,
        };
        let target = Target::parse(&options, tls.as_ref()).map_err(|found| {
            found
                .into_iter()
                .map(|problem| Problem::new("url", problem))
                .collect::<Vec<_>>()
        })?;
        let timeout = options.request_timeout;
        let millis = |d: Duration| d.as_millis().to_string();
        // One view of whether Redis can be reached, for the locks and the release watch alike.
        let health = Arc::new(Health::new(OUTAGE_FIRST, OUTAGE_MOST));
        Ok(RedisBackend {
            inner: Arc::new(Backend {
                releases: ReleaseWatch::new(target.clone(), timeout, health.clone()),
                connection: Connection::new(target, timeout, health),
                scripts: Scripts::protocol(),
                prefix: options.key_prefix,
                lease: options.lease_duration,
                timeout,
                lease_ms: millis(options.lease_duration),
                intent_ms: millis(options.writer_intent),
                intent: options.writer_intent,
                replication: (options.replicas > 0).then_some(Replication {
                    replicas: options.replicas,
                    timeout: options.replica_timeout,
                }),
                holders: HolderIds::new(),
            }),
        })
    }

    /// Checks at startup, on connections of its own that it closes, what building a backend
    /// cannot: that Redis answers and accepts the credentials, that this user may load and run
    /// the lock scripts (they are loaded, on a cluster into every primary), publish and
    /// subscribe on the prefix's channels (`&{prefix}:*`), and — where the user may read it —
    /// that `maxmemory-policy` is `noeviction` (any other policy is logged as a warning: it can
    /// evict held locks). No lock is taken; nothing but the scripts is left on the server.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured) for refused
    /// credentials or permissions (naming what is missing), or
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) when Redis does not answer
    /// within `request_timeout`.
    pub async fn verify(&self) -> Result<(), LockError> {
        self.check().await.map_err(BackendError::into_lock_error)
    }

    /// What [`verify`](Self::verify) checks, as the backend reports it.
    async fn check(&self) -> Result<(), BackendError> {
        let inner = &*self.inner;
        check::run(
            &inner.connection,
            inner.scripts,
            &inner.prefix,
            inner.timeout,
        )
        .await
    }

    /// The lease duration.
    pub fn lease_duration(&self) -> Duration {
        self.inner.lease
    }

    /// The prefix of every key name.
    pub fn key_prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// Whether the pub/sub connection that wakes this process's waiters is open now, the server
    /// having confirmed its subscriptions (0 or 1); it opens while someone waits for a key held
    /// elsewhere.
    pub fn wait_connections(&self) -> usize {
        self.inner.releases.connections()
    }

    /// One attempt in `mode`; on a failure with no answer, the holder id is given back in the
    /// background in case the request ran after all.
    async fn attempt(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<RedisLease>>, BackendError> {
        let inner = &*self.inner;
        let holder = inner.holders.next();
        let held = match mode {
            LockMode::Exclusive => Held::Exclusive(RedisLockKeys::lock(&inner.prefix, key)),
            LockMode::Shared => Held::Shared(RedisLockKeys::lock(&inner.prefix, key)),
            LockMode::Semaphore { .. } => Held::Slot(RedisLockKeys::semaphore(&inner.prefix, key)),
        };
        let count = match mode {
            LockMode::Semaphore { max_count } => max_count.to_string(),
            _ => String::new(),
        };
        let (script, keys, args): (&Script, Vec<&str>, Vec<&str>) = match &held {
            Held::Exclusive(n) => (
                &inner.scripts.acquire,
                vec![&n.lock, &n.readers, &n.intent, &n.fence],
                vec![&holder, &inner.lease_ms, &inner.intent_ms],
            ),
            Held::Shared(n) => (
                &inner.scripts.acquire_shared,
                vec![&n.lock, &n.readers, &n.intent, &n.fence],
                vec![&holder, &inner.lease_ms],
            ),
            Held::Slot(n) => (
                &inner.scripts.acquire_slot,
                vec![&n.holders, &n.fence],
                vec![&holder, &inner.lease_ms, &count],
            ),
        };
        let answered = eval::run(
            &inner.connection,
            Stage::Attempt,
            script,
            &keys,
            &args,
            inner.replication,
        )
        .await;
        let lease = RedisLease { held, holder };
        match answered {
            Ok(answer) => self.taken(lease, answer).await,
            Err(failed) => {
                // Only a request that went out and got no answer may have taken the lock; one
                // refused before it was sent, or that the server answered, took nothing.
                let unanswered =
                    failed.error.kind() == (BackendErrorKind::Transient { reached: false });
                if failed.sent && unanswered {
                    let backend = self.clone();
                    tokio::spawn(async move {
                        let _ = backend.give_back(&lease).await;
                    });
                }
                Err(failed.error)
            }
        }
    }

    /// What an attempt's answer means: busy, a lease, or a lease too few replicas saw (given
    /// back at once).
    async fn taken(
        &self,
        lease: RedisLease,
        answer: Answer,
    ) -> Result<Option<Acquired<RedisLease>>, BackendError> {
        if answer.value == 0 {
            return Ok(None);
        }
        let Ok(fencing_token) = u64::try_from(answer.value) else {
            return Err(BackendError::permanent(
                "the lock attempt: Redis answered a negative fencing token",
            ));
        };
        if let Some(short) = self.short_of_replicas(answer) {
            let _ = self.give_back(&lease).await;
            return Err(BackendError::transient(format!(
                "the lock attempt: {short}; the lock was given back"
            )));
        }
        Ok(Some(Acquired {
            lease,
            fencing_token,
        }))
    }

    /// A description of the shortfall when fewer replicas than asked acknowledged a write.
    fn short_of_replicas(&self, answer: Answer) -> Option<String> {
        let replication = self.inner.replication?;
        let acknowledged = answer.acknowledged.unwrap_or(0);
        (acknowledged < i64::from(replication.replicas)).then(|| {
            format!(
                "only {acknowledged} of {} replicas acknowledged it within {:?}",
                replication.replicas, replication.timeout
            )
        })
    }

    /// Deletes the lease's holder id where it is still the holder, publishing the release.
    async fn give_back(&self, lease: &RedisLease) -> Result<Answer, BackendError> {
        let inner = &*self.inner;
        let (script, key, channel) = match &lease.held {
            Held::Exclusive(n) => (&inner.scripts.release, &n.lock, n.released.as_str()),
            Held::Shared(n) => (
                &inner.scripts.release_member,
                &n.readers,
                n.released.as_str(),
            ),
            Held::Slot(n) => (&inner.scripts.release_member, &n.holders, ""),
        };
        eval::run(
            &inner.connection,
            Stage::Release,
            script,
            &[key],
            &[&lease.holder, channel],
            None,
        )
        .await
        .map_err(BackendError::from)
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL is left out: it may carry the password.
        f.debug_struct("RedisBackend")
            .field("lease_duration", &self.inner.lease)
            .field("key_prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

impl LockBackend for RedisBackend {
    type Lease = RedisLease;

    fn provider(&self) -> &str {
        PROVIDER
    }

    fn timing(&self) -> LeaseTiming {
        LeaseTiming::Expiring(self.inner.lease)
    }

    /// See [`RedisBackend::verify`].
    async fn verify(&self) -> Result<(), BackendError> {
        self.check().await
    }

    /// Closes the lock connection (on a cluster, the cluster client's) and the pub/sub
    /// connection. Called once the engine has released its locks; clones of this backend lose
    /// their connections too, and a request made afterwards opens a new one.
    async fn shutdown(&self) {
        self.inner.releases.stop();
        self.inner.connection.close();
    }

    /// Exclusive locks, readers, and semaphores of 1 to [`MAX_SEMAPHORE_COUNT`] holders.
    fn supports(&self, mode: LockMode) -> bool {
        mode.with_semaphores_up_to(MAX_SEMAPHORE_COUNT)
    }

    fn writer_intent(&self) -> Option<Duration> {
        Some(self.inner.intent)
    }

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<RedisLease>>, BackendError> {
        if !self.supports(mode) {
            return Err(BackendError::misconfigured(format!(
                "the redis provider does not support {mode} locks of this size (a semaphore has \
                 1 to {MAX_SEMAPHORE_COUNT} holders)"
            )));
        }
        self.attempt(key, mode).await
    }

    async fn renew(&self, lease: &RedisLease) -> Result<(), BackendError> {
        let inner = &*self.inner;
        let (script, key) = match &lease.held {
            Held::Exclusive(n) => (&inner.scripts.renew, &n.lock),
            Held::Shared(n) => (&inner.scripts.renew_member, &n.readers),
            Held::Slot(n) => (&inner.scripts.renew_member, &n.holders),
        };
        let answer = eval::run(
            &inner.connection,
            Stage::Renew,
            script,
            &[key],
            &[&lease.holder, &inner.lease_ms],
            inner.replication,
        )
        .await?;
        if answer.value != 1 {
            return Err(BackendError::lease_gone(
                "the lease renewal: the key is gone or held by someone else (it expired, was \
                 deleted or was overwritten)",
            ));
        }
        match self.short_of_replicas(answer) {
            // Not yet loss: the renewal is retried until the deadline, which stays where the
            // last renewal enough replicas saw put it.
            Some(short) => Err(BackendError::transient(format!(
                "the lease renewal: {short}"
            ))),
            None => Ok(()),
        }
    }

    async fn release(&self, lease: &RedisLease) -> Result<(), BackendError> {
        match self.give_back(lease).await?.value {
            1 => Ok(()),
            _ => Err(BackendError::lease_gone(
                "the release: the key had expired or was held by someone else",
            )),
        }
    }

    /// Plain attempts, woken for plain locks and readers by the key's `released` channel, on
    /// which every release of the lock or of a reader is published (see `watch`). Semaphore
    /// releases publish nothing, so their waits poll.
    fn wait(
        self: Arc<Self>,
        key: &str,
        mode: LockMode,
    ) -> impl crate::backend::Wait<Lease = Self::Lease> + use<> {
        wait::RedisWait::open(self, key, mode)
    }
}

/// Locks `mutex`, whose every critical section leaves the value consistent, so a poisoned lock
/// is still usable.
fn locked<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A held Redis lease: which names hold it and the holder id it is held under.
///
/// `Debug` shows neither: the names contain the key.
pub struct RedisLease {
    held: Held,
    holder: String,
}

/// Where a lease lives.
enum Held {
    Exclusive(RedisLockNames),
    Shared(RedisLockNames),
    Slot(RedisSemaphoreNames),
}

impl RedisLease {
    /// The random holder id the lease is held under: the value of the lock's string
    /// (`GET {prefix}:{{key}}`), or the member of the readers' or semaphore's sorted set.
    pub fn holder_id(&self) -> &str {
        &self.holder
    }

    /// The Redis key that holds the lease: the lock's string, or the readers' or the
    /// semaphore's sorted set.
    pub fn redis_key(&self) -> &str {
        match &self.held {
            Held::Exclusive(n) => &n.lock,
            Held::Shared(n) => &n.readers,
            Held::Slot(n) => &n.holders,
        }
    }
}

impl fmt::Debug for RedisLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLease").finish_non_exhaustive()
    }
}

/// Random holder ids: 128 bits from a keyed hash (SipHash with this process's random keys) of a
/// counter, so ids never repeat in a process and collide across processes only by chance.
struct HolderIds {
    seed: std::collections::hash_map::RandomState,
    next: AtomicU64,
}

impl HolderIds {
    fn new() -> Self {
        HolderIds {
            seed: std::collections::hash_map::RandomState::new(),
            next: AtomicU64::new(0),
        }
    }

    fn next(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let high = self.seed.hash_one((n, 0u8));
        let low = self.seed.hash_one((n, 1u8));
        format!("{high:016x}{low:016x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_attempt_that_never_went_out_gives_nothing_back() {
        // Nothing listens on port 1 of loopback: the first connect is refused, and the outage
        // gate refuses the next attempts without a connect.
        let backend =
            RedisBackend::new(RedisOptions::new("redis://127.0.0.1:1")).expect("valid options");
        let tasks = || {
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks()
        };
        let before = tasks();
        for _ in 0..3 {
            let Err(error) = backend.try_acquire("k", LockMode::Exclusive).await else {
                panic!("nothing listens")
            };
            assert_eq!(
                error.kind(),
                BackendErrorKind::Transient { reached: false },
                "{error}"
            );
        }
        assert_eq!(
            tasks(),
            before,
            "a give-back was spawned for an unsent request"
        );
    }
}
