//! The PostgreSQL provider: session-level advisory locks (`feature = "postgres"`).
//!
//! A lock is `pg_try_advisory_lock(k)` on a connection of its own, where `k` is
//! [`PostgresLockKeys::advisory_key`] of the key. The lock lives exactly as long as that
//! session. The lock is declared lost the moment its connection closes (a terminated session,
//! a server that stopped or crashed), and the engine also checks the connection every
//! [`check_interval`](PostgresOptions::check_interval): a check that fails or does not answer
//! in time is loss too (a frozen server, a silent network).
//!
//! # Guarantees and caveats
//! - **One connection per held lock**, taken out of the pool's rotation while held. Session
//!   locks are reentrant on one connection, so a connection that holds a lock never serves
//!   another attempt.
//! - **A connection whose unlock was not confirmed is closed, never reused**: closing ends the
//!   session, and the server frees every lock it held. The same goes for a connection that
//!   failed a statement or timed out while it held (or may have just taken) a lock. Only a
//!   connection whose `pg_advisory_unlock` answered `true`, or whose attempt answered "busy",
//!   goes back to the pool.
//! - **Every statement has its own timeout** ([`query_timeout`](PostgresOptions::query_timeout)):
//!   a frozen server otherwise hangs a call forever, and TCP keepalive does not notice a
//!   stopped server process. TCP keepalive is still on, so a vanished network is noticed too.
//! - **Fencing tokens** come from a sequence (`lockingkit.fencing_tokens` by default) in the
//!   same round trip as the lock: `SELECT nextval(…) FROM (SELECT pg_try_advisory_lock($1) AS
//!   ok OFFSET 0) s WHERE ok`. A busy attempt leaves the sequence alone. Sequences are durable,
//!   so tokens keep growing across server restarts. The schema and sequence are created on
//!   first use (serialized by a transaction-level advisory lock, so processes starting together
//!   do not race); a role without CREATE on the database needs them created beforehand, with
//!   USAGE on the schema and USAGE, UPDATE on the sequence.
//! - **Hand-off across processes in milliseconds**: for each key a process waits for, its
//!   backend keeps a watcher session (never one of the pool's) queued for a shared lock on the
//!   same advisory key. The server grants it the moment the lock is freed — by LockingKit, by
//!   plain SQL or by the holder's session ending — and the waiter retries at once instead of
//!   at its next backoff step. The release is a plain `pg_advisory_unlock`. Polling stays the
//!   fallback (more than 16 keys waited for at once, a server that cannot be reached).
//! - **Not replicated**: advisory locks live in one server's memory. After a failover every
//!   lock is gone and every holder sees loss. Locks are per database. PgBouncer in transaction
//!   or statement pooling mode breaks session locks; use session pooling or connect directly.

mod connection;
mod errors;
mod options;
mod session;
mod tls;
mod watch;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use deadpool::managed::{PoolError, TimeoutType, Timeouts};
use tokio_util::sync::CancellationToken;

pub use options::{
    PostgresOptions, DEFAULT_CHECK_INTERVAL, DEFAULT_FENCING_SCHEMA, DEFAULT_FENCING_SEQUENCE,
    DEFAULT_POOL_SIZE, DEFAULT_QUERY_TIMEOUT,
};

use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use crate::engine::misconfigured;
use crate::error::LockError;
use crate::keys::PostgresLockKeys;
use errors::Stage;
use session::{Bounded, Connector, PooledSession, Prepared, Session, SessionPool};

/// The provider name in telemetry.
pub const PROVIDER: &str = "postgres";

/// The transaction-level advisory lock that serializes creating the fencing objects. It uses
/// the two-`int4` key space, which never meets the single-`bigint` keys of LockingKit locks.
const FENCING_SETUP_LOCK: (i32, i32) = (0x6c6b_6974, 0x6665_6e63); // "lkit", "fenc"

/// The unlock. Waiters in other processes learn of it from the server itself (see `watch`).
const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";
const CHECK: &str = "SELECT 1";

/// The PostgreSQL backend: a connection pool and the statements of the lock protocol.
///
/// ```no_run
/// use lockingkit::{DistributedLock, PostgresBackend, PostgresOptions};
///
/// # async fn run() -> Result<(), lockingkit::LockError> {
/// let backend = PostgresBackend::new(PostgresOptions::new(
///     "postgres://app:secret@db.internal/app?sslmode=verify-full",
/// ))?;
/// let locks = DistributedLock::builder(backend).name("Jobs").build()?;
/// let handle = locks.try_acquire("jobs/nightly-export").await?;
/// // … work, sending handle.fencing_token() with every write …
/// handle.release().await?;
/// # Ok(()) }
/// ```
pub struct PostgresBackend {
    pool: SessionPool,
    pool_size: usize,
    timeout: Duration,
    check_interval: Duration,
    /// The lock statement with the fencing sequence spliced in.
    lock: String,
    fencing_exists: String,
    fencing_setup: String,
    /// Set once the fencing objects are known to exist; cleared if a statement finds them gone.
    fencing_ready: AtomicBool,
    /// Wakes this process's waiters when their key is freed.
    releases: watch::ReleaseWatch,
}

impl PostgresBackend {
    /// Validates `options` and prepares the pool. No connection is opened until the first
    /// attempt, so a server that is down at startup is reported by the attempts, as
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable), not here.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured), listing every
    /// problem, when the options are invalid or the TLS settings cannot be honoured (an
    /// unreadable `sslrootcert`, no trust store for `verify-full`).
    pub fn new(options: PostgresOptions) -> Result<Self, LockError> {
        let section = "Locking.Postgres";
        let mut problems = options.problems(section);
        if !problems.is_empty() {
            return Err(misconfigured(&problems));
        }
        let mut settings = connection::parse(options.connection_string.expose())
            .map_err(|p| misconfigured(&[format!("{section}.connection_string: {p}")]))?;
        let tls = match tls::connector(&settings) {
            Ok(tls) => Some(tls),
            Err(problem) => {
                problems.push(format!("{section}.connection_string: {problem}"));
                None
            }
        };
        let (Some(tls), true) = (tls, problems.is_empty()) else {
            return Err(misconfigured(&problems));
        };
        let config = &mut settings.config;
        // A vanished peer is noticed by keepalive probes within about a minute instead of
        // the kernel's two hours; settings from the connection string win.
        config.keepalives(true);
        if config.get_keepalives_idle() >= Duration::from_secs(7200) {
            config.keepalives_idle(Duration::from_secs(30));
        }
        if config.get_keepalives_interval().is_none() {
            config.keepalives_interval(Duration::from_secs(10));
        }
        if config.get_keepalives_retries().is_none() {
            config.keepalives_retries(3);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(options.query_timeout);
        }
        // Lets an operator find lock sessions in pg_stat_activity.
        if config.get_application_name().is_none() {
            config.application_name("lockingkit");
        }
        let releases = watch::ReleaseWatch::new(settings.config.clone(), tls.clone());
        let timeout = options.query_timeout;
        let connector = Connector {
            config: settings.config,
            tls,
            timeout,
        };
        let pool = SessionPool::builder(connector)
            .max_size(options.pool_size)
            // The most recently returned session first: its socket and statements are warm.
            .queue_mode(deadpool::managed::QueueMode::Lifo)
            .runtime(deadpool::Runtime::Tokio1)
            .build()
            .map_err(|e| misconfigured(&[format!("{section}: the pool cannot be built ({e})")]))?;
        let sequence = format!("{}.{}", options.fencing_schema, options.fencing_sequence);
        Ok(PostgresBackend {
            pool,
            pool_size: options.pool_size,
            timeout,
            check_interval: options.check_interval,
            lock: format!(
                "SELECT nextval('{sequence}') FROM (SELECT pg_try_advisory_lock($1) AS ok OFFSET 0) s WHERE ok"
            ),
            fencing_exists: format!("SELECT to_regclass('{sequence}') IS NOT NULL"),
            fencing_setup: format!(
                "SELECT pg_advisory_xact_lock({}, {});\
                 CREATE SCHEMA IF NOT EXISTS {};\
                 CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint MINVALUE 1 NO CYCLE CACHE 1;",
                FENCING_SETUP_LOCK.0, FENCING_SETUP_LOCK.1, options.fencing_schema
            ),
            fencing_ready: AtomicBool::new(false),
            releases,
        })
    }

    /// How many connections the pool holds now, idle or in use (held locks included).
    pub fn pool_connections(&self) -> usize {
        self.pool.status().size
    }

    /// How many idle connections wait in the pool.
    pub fn idle_connections(&self) -> usize {
        self.pool.status().available
    }

    async fn checkout(&self) -> Result<Checkout, BackendError> {
        // An idle session is taken without arming any timer: deadpool builds a tokio timeout
        // for each bounded step even when the step is ready at once, which measurably slows
        // every lock. Only when every session is in use (held locks) does the checkout wait,
        // bounded. Opening a session is bounded inside the connector.
        let at_once = Timeouts {
            wait: Some(Duration::ZERO),
            create: None,
            recycle: None,
        };
        let result = match self.pool.timeout_get(&at_once).await {
            Err(PoolError::Timeout(TimeoutType::Wait)) => {
                let waiting = Timeouts {
                    wait: Some(self.timeout),
                    create: None,
                    recycle: None,
                };
                // Boxed: the pool's future is over a kilobyte, and this path is rare; inline it
                // would enlarge every attempt's future, which is moved into a box per call.
                Box::pin(self.pool.timeout_get(&waiting)).await
            }
            other => other,
        };
        match result {
            Ok(session) => Ok(Checkout(Some(session))),
            Err(error) => Err(errors::pool_error(error, self.pool_size, self.timeout)),
        }
    }

    /// Runs one statement on `session` under the statement timeout, classifying its failure
    /// for `stage`.
    fn run<'a, F: Future>(
        &'a self,
        stage: Stage,
        session: &'a Session,
        statement: F,
    ) -> Run<'a, F> {
        Run {
            bounded: session.bounded(self.timeout, statement),
            stage,
            backend: self,
        }
    }

    /// Creates the fencing schema and sequence unless they exist.
    async fn ensure_fencing(&self, session: &Session) -> Result<(), BackendError> {
        let client = session.client();
        // Checking first lets a role without CREATE use objects an administrator made:
        // CREATE SCHEMA checks the privilege before IF NOT EXISTS.
        let row = self
            .run(
                Stage::Attempt,
                session,
                client.query_one(&self.fencing_exists, &[]),
            )
            .await?;
        let exists: bool = row
            .try_get(0)
            .map_err(|_| BackendError::permanent("unexpected answer to the fencing check"))?;
        if !exists {
            self.run(
                Stage::Attempt,
                session,
                client.batch_execute(&self.fencing_setup),
            )
            .await?;
        }
        self.fencing_ready.store(true, Ordering::Release);
        Ok(())
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("pool_size", &self.pool_size)
            .field("query_timeout", &self.timeout)
            .field("check_interval", &self.check_interval)
            .finish_non_exhaustive()
    }
}

impl LockBackend for PostgresBackend {
    type Lease = PostgresLease;

    fn provider(&self) -> &str {
        PROVIDER
    }

    fn timing(&self) -> LeaseTiming {
        LeaseTiming::ConnectionHeld(self.check_interval)
    }

    async fn try_acquire(
        &self,
        key: &str,
    ) -> Result<Option<Acquired<PostgresLease>>, BackendError> {
        let advisory_key = PostgresLockKeys::advisory_key(key);
        // From here until the answer is read, any exit (an error, a timeout, this future being
        // dropped) closes the connection: the lock may have been taken on it.
        let checkout = self.checkout().await?;
        let session = checkout.session()?;
        if !self.fencing_ready.load(Ordering::Acquire) {
            // Boxed: it runs once per backend, and inline it would enlarge every attempt.
            Box::pin(self.ensure_fencing(session)).await?;
        }
        let statement = self
            .run(
                Stage::Attempt,
                session,
                session.statement(Prepared::Lock, &self.lock),
            )
            .await?;
        let row = self
            .run(
                Stage::Attempt,
                session,
                session.client().query_opt(&statement, &[&advisory_key]),
            )
            .await?;
        let Some(row) = row else {
            // Busy: the session took nothing, so the connection is clean.
            checkout.return_to_pool();
            return Ok(None);
        };
        let token: i64 = row
            .try_get(0)
            .map_err(|_| BackendError::permanent("unexpected answer to the lock statement"))?;
        let fencing_token = u64::try_from(token).map_err(|_| {
            BackendError::permanent("the fencing sequence returned a negative value")
        })?;
        let ended = session.ended().clone();
        Ok(Some(Acquired {
            lease: PostgresLease {
                advisory_key,
                ended,
                session: tokio::sync::Mutex::new(checkout.into_session()),
            },
            fencing_token,
        }))
    }

    async fn renew(&self, lease: &PostgresLease) -> Result<(), BackendError> {
        let mut slot = lease.session.lock().await;
        let Some(session) = slot.as_ref() else {
            return Err(BackendError::lease_gone(
                "the lock's PostgreSQL connection was already closed",
            ));
        };
        if session.is_closed() {
            discard(slot.take());
            return Err(BackendError::lease_gone(
                "the lock's PostgreSQL connection closed",
            ));
        }
        let checked = async {
            let statement = self
                .run(
                    Stage::Held,
                    session,
                    session.statement(Prepared::Check, CHECK),
                )
                .await?;
            self.run(
                Stage::Held,
                session,
                session.client().query_one(&statement, &[]),
            )
            .await
        }
        .await;
        match checked {
            Ok(_) => Ok(()),
            Err(error) => {
                discard(slot.take());
                Err(error)
            }
        }
    }

    async fn release(&self, lease: &PostgresLease) -> Result<(), BackendError> {
        // Taken out of the lease first, so that if this future is dropped mid-statement the
        // checkout's drop closes the connection instead of leaving it with the lease.
        let checkout = Checkout(lease.session.lock().await.take());
        let session = checkout.session().map_err(|_| {
            BackendError::lease_gone("the lock's PostgreSQL connection was already closed")
        })?;
        let statement = self
            .run(
                Stage::Release,
                session,
                session.statement(Prepared::Unlock, UNLOCK),
            )
            .await?;
        let row = self
            .run(
                Stage::Release,
                session,
                session
                    .client()
                    .query_one(&statement, &[&lease.advisory_key]),
            )
            .await?;
        match row.try_get::<_, bool>(0) {
            Ok(true) => {
                // This session held exactly this one advisory lock (no attempt ever runs on a
                // held connection), so after a confirmed unlock it holds none.
                checkout.return_to_pool();
                Ok(())
            }
            _ => Err(BackendError::lease_gone(
                "PostgreSQL says the session no longer held the lock",
            )),
        }
    }

    fn release_hint(&self, key: &str) -> impl Future<Output = ()> + Send + 'static {
        self.releases.subscribe(PostgresLockKeys::advisory_key(key))
    }

    fn lease_ended(&self, lease: &PostgresLease) -> impl Future<Output = ()> + Send {
        lease.ended.clone().cancelled_owned()
    }
}

pin_project_lite::pin_project! {
    /// One statement under the statement timeout (see [`PostgresBackend::run`]). Written out
    /// rather than as an `async fn`, which would keep the statement's future twice (the
    /// argument, and the value it awaits): every attempt and release is moved into a box per
    /// call, so its size costs on every lock.
    #[must_use = "a statement does nothing until it is awaited"]
    struct Run<'a, F> {
        #[pin]
        bounded: Bounded<'a, F>,
        stage: Stage,
        backend: &'a PostgresBackend,
    }
}

impl<T, F: Future<Output = Result<T, tokio_postgres::Error>>> Future for Run<'_, F> {
    type Output = Result<T, BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        Poll::Ready(match std::task::ready!(this.bounded.poll(cx)) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => {
                if errors::is_missing_object(&error) {
                    this.backend.fencing_ready.store(false, Ordering::Release);
                }
                Err(errors::query_error(error, *this.stage))
            }
            Err(_) => Err(errors::timed_out(*this.stage, this.backend.timeout)),
        })
    }
}

/// A held PostgreSQL advisory lock: the connection whose session holds it.
///
/// Dropping a lease that was not released closes its connection, which ends the session and
/// frees the lock at the server.
pub struct PostgresLease {
    advisory_key: i64,
    /// Cancelled when the session ends, whoever ends it.
    ended: CancellationToken,
    session: tokio::sync::Mutex<Option<PooledSession>>,
}

impl PostgresLease {
    /// The advisory key held, as `pg_locks` shows it (`classid` high and `objid` low 32 bits,
    /// `objsubid = 1`).
    pub fn advisory_key(&self) -> i64 {
        self.advisory_key
    }
}

impl fmt::Debug for PostgresLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresLease").finish_non_exhaustive()
    }
}

impl Drop for PostgresLease {
    fn drop(&mut self) {
        discard(self.session.get_mut().take());
    }
}

/// A session checked out for one operation. Dropped without [`Checkout::return_to_pool`], it
/// closes the connection: whatever happened on it, no lock can be left behind in the pool.
struct Checkout(Option<PooledSession>);

impl Checkout {
    fn session(&self) -> Result<&Session, BackendError> {
        self.0
            .as_deref()
            .ok_or_else(|| BackendError::permanent("internal: the connection was handed on"))
    }

    /// Puts a clean session (holding no lock) back into the pool.
    fn return_to_pool(mut self) {
        drop(self.0.take());
    }

    /// Hands the session on to a lease.
    fn into_session(mut self) -> Option<PooledSession> {
        self.0.take()
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        discard(self.0.take());
    }
}

/// Closes a session instead of returning it to the pool: the server ends it and frees its
/// locks.
fn discard(session: Option<PooledSession>) {
    if let Some(session) = session {
        drop(PooledSession::take(session));
    }
}
