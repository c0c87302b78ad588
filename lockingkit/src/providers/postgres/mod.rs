//! The PostgreSQL provider: session-level advisory locks (`feature = "postgres"`).
//!
//! A lock is `pg_try_advisory_lock(k)` on one of a few server sessions that the backend's locks
//! share, where `k` is [`PostgresLockKeys::advisory_key`] of the key; readers take it shared,
//! and semaphores take slots in a lock space of their own. The lock lives exactly as
//! long as that session holds it. It is declared lost the moment the session ends (a terminated
//! session, a server that stopped or crashed), and the session is checked every
//! [`check_interval`](PostgresOptions::check_interval): a check that fails or does not answer
//! in time ends the session, which is loss for every lock on it (a frozen server, a silent
//! network).
//!
//! # Guarantees and caveats
//! - **Locks share sessions**: at most [`max_sessions`](PostgresOptions::max_sessions) per
//!   backend, each holding any number of locks; concurrent attempts, unlocks and checks are
//!   pipelined on them. The connections a process uses do not grow with the locks it holds.
//! - **Never by re-entrancy**: session locks are reentrant, so a session takes a key at most
//!   once, and a key whose attempt or unlock went unanswered is not taken on that session
//!   again until the server has answered an unlock of it.
//! - **An unconfirmed unlock never drops the other locks on its session**: the session stops
//!   taking new locks and retries the unlock until the server answers; it closes (freeing
//!   everything it may hold) only once no other lock depends on it, or when it is broken
//!   anyway (a failed check).
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
//! - **Readers and writers**: a shared hold is `pg_try_advisory_lock_shared(k)` on the same key
//!   (fencing token in the same round trip), released with `pg_advisory_unlock_shared(k)`. The
//!   server counts a session's shared holds of a key, so several readers of one process may
//!   share a session, each lease unlocking once; a session never takes a key exclusively while
//!   it holds it shared (the server would grant it: one session's locks never conflict), nor
//!   shared while it holds it exclusively.
//! - **Semaphores**: slot `s` of the semaphore `k` is the two-`int4` advisory lock
//!   `(PostgresLockKeys::semaphore_key(k), s)`, a lock space apart from plain keys. One
//!   statement tries the slots from a random one on, skipping those its session holds, and takes
//!   the first free one with its fencing token: one round trip per attempt, busy or not. At
//!   most [`MAX_SEMAPHORE_COUNT`] slots.
//! - **Hand-off across processes in milliseconds, and the writer the server grants**: for each
//!   key a process waits for, its backend keeps a watcher: a waiting session queued for the same
//!   key (exclusively while a writer waits, shared while only readers do), in statements that
//!   give up after half a second and are sent again, so no snapshot is held for longer. The lock
//!   the server grants the watcher is kept, with its fencing token from the same statement, and
//!   becomes the waiter's lock at its next attempt (see `waiting`): queued exclusively, the
//!   watcher is the waiting writer's intent, which new readers respect, and nothing lies between
//!   the grant and the writer's take. Polling stays the fallback.
//! - **Locks inside the caller's own transaction** are the other shape:
//!   [`PostgresTransactionLocks`] takes `pg_try_advisory_xact_lock` on a transaction the caller
//!   owns, with the same keys and fencing sequence, held until COMMIT or ROLLBACK.
//! - **Not replicated**: advisory locks live in one server's memory. After a failover every
//!   lock is gone and every holder sees loss. Locks are per database.
//! - **Session pooling only**: a pooler in transaction or statement mode (PgBouncer's
//!   `pool_mode`) would lend a lock's server session to other clients. It is looked for when a
//!   session opens and in every check, and refused with `Misconfigured` (see `pooler`).

mod connection;
mod errors;
pub(crate) mod keys;
mod lock_sessions;
mod options;
mod pooler;
mod provider;
mod schema;
mod session;
mod tls;
mod transaction;
mod waiting;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio_postgres::types::ToSql;

pub use options::{PostgresOptions, DEFAULT_FENCING_SCHEMA, DEFAULT_FENCING_SEQUENCE};
pub(crate) use provider::Postgres;
pub use schema::setup_sql;
pub use transaction::{
    LockableTransaction, PostgresTransactionLock, PostgresTransactionLocks,
    PostgresTransactionOptions,
};

use crate::backend::MAX_SEMAPHORE_COUNT;
use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend, LockMode};
use crate::config::Problem;
use crate::error::LockError;
use errors::Stage;
use keys::PostgresLockKeys;
use lock_sessions::LockSessions;
use session::{Advisory, Attempt, Bounded, Prepared, Session, SessionSettings};
use waiting::Watchers;

/// The provider name in telemetry.
pub(crate) const PROVIDER: &str = "postgres";

/// The unlock. Waiters in other processes learn of it from the server itself (see `waiting`).
const UNLOCK: &str = "SELECT pg_advisory_unlock($1)";
/// The unlock of one shared hold.
const UNLOCK_SHARED: &str = "SELECT pg_advisory_unlock_shared($1)";
/// The unlock of one semaphore slot.
const UNLOCK_SLOT: &str = "SELECT pg_advisory_unlock($1, $2)";
/// Unlocks the slots of semaphore `$1` this session holds, except the slots `$2` that leases
/// hold: what settles a semaphore attempt that went unanswered, whichever slot it took.
const UNLOCK_STRAY_SLOTS: &str =
    "SELECT pg_advisory_unlock($1, objid::bigint::int4) FROM pg_locks \
     WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND pid = pg_backend_pid() \
     AND classid = $1::oid AND NOT objid::bigint::int4 = ANY($2)";
/// The session check; its answer also shows a session that a pooler moved (see `pooler`).
const CHECK: &str = pooler::SERVER_PROCESS;

/// The rows of `pg_locks` for a `bigint` advisory key `$1` this session holds, in `mode`.
macro_rules! held_key_rows {
    ($mode:literal) => {
        concat!(
            " FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid() \
             AND mode = '",
            $mode,
            "' AND objsubid = 1 AND classid = (($1 >> 32) & 4294967295)::oid \
             AND objid = ($1 & 4294967295)::oid \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    };
}

/// Settling an unlock that went unanswered: an unlock of a lock the session does not hold
/// makes the server log a WARNING ("you don't own a lock of type …"), so these unlock only
/// what `pg_locks` shows the session holding, and answer no row otherwise.
const UNLOCK_IF_HELD: &str = concat!(
    "SELECT pg_advisory_unlock($1)",
    held_key_rows!("ExclusiveLock")
);
/// One shared hold of `$1`, if the session has one: sent until it answers no row.
const UNLOCK_SHARED_IF_HELD: &str = concat!(
    "SELECT pg_advisory_unlock_shared($1)",
    held_key_rows!("ShareLock")
);
/// Slot `$2` of semaphore `$1`, if the session holds it.
const UNLOCK_SLOT_IF_HELD: &str = "SELECT pg_advisory_unlock($1, $2) FROM pg_locks \
     WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND pid = pg_backend_pid() \
     AND classid = $1::oid AND objid::bigint::int4 = $2";

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
///
/// Clones share the sessions, the watchers and the fencing state: two `DistributedLock`s built
/// from clones of one backend use one connection budget, and a key one of them holds is busy
/// for the other (never taken twice by re-entrancy on a shared session).
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Backend>,
}

/// What the clones of one [`PostgresBackend`] share.
struct Backend {
    sessions: Arc<LockSessions>,
    /// Whether a transaction- or statement-mode pooler was found in front of the server.
    pooling: Arc<pooler::Pooling>,
    max_sessions: usize,
    timeout: Duration,
    check_interval: Duration,
    /// The lock statements with the fencing sequence spliced in: exclusive, shared, shared on a
    /// session that holds the key shared already, and a semaphore slot.
    lock: String,
    lock_shared: String,
    lock_shared_again: String,
    lock_slot: String,
    /// Spreads the first slot semaphore attempts try (see `slot_offset`).
    offsets: std::collections::hash_map::RandomState,
    attempts: std::sync::atomic::AtomicU64,
    /// The sequence and the watch function, and how to create them.
    schema: Arc<schema::Schema>,
    /// Set once the fencing objects are known to exist; cleared if a statement finds them gone.
    fencing_ready: AtomicBool,
    /// How every session opens, lock sessions and waiting sessions alike.
    settings: Arc<SessionSettings>,
    /// Wakes this process's waiters when their key is freed.
    watchers: Watchers,
}

impl PostgresBackend {
    /// Validates `options` and prepares the sessions. No connection is opened until the first
    /// attempt, so a server that is down at startup is reported by the attempts, as
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable), not here.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured), listing every
    /// problem, when the options are invalid or the TLS settings cannot be honoured (an
    /// unreadable `sslrootcert`, no trust store for `verify-full`).
    pub fn new(options: PostgresOptions) -> Result<Self, LockError> {
        Self::open(options)
            .map_err(|problems| crate::config::misconfigured_at("PostgresOptions", problems))
    }

    /// [`new`](Self::new), with the problems as data, for the registry to place in the
    /// section the options came from.
    pub(crate) fn open(options: PostgresOptions) -> Result<Self, Vec<Problem>> {
        let problems = options.problems();
        if !problems.is_empty() {
            return Err(problems);
        }
        let mut settings = connection::parse(options.connection_string.expose())
            .map_err(|problem| vec![Problem::detail("connection_string", problem)])?;
        // What the options cannot say alone: TLS settings this machine cannot honour.
        let tls = tls::connector(&settings)
            .map_err(|problem| vec![Problem::detail("connection_string", problem)])?;
        tune_connection(&mut settings.config, options.query_timeout);
        let timeout = options.query_timeout;
        let max_sessions = options.max_sessions;
        // Shared by the sessions, which verify at open and in every check that no pooler
        // hands their server session to others (see `pooler`).
        let pooling = Arc::new(pooler::Pooling::default());
        // Lock sessions and waiting sessions open the same way, and back off together when
        // the server refuses connections.
        let session_settings = Arc::new(SessionSettings {
            config: settings.config,
            tls,
            timeout,
            reconnect: Arc::new(crate::providers::reconnect::Reconnect::new()),
            pooling: pooling.clone(),
        });
        let schema = Arc::new(schema::Schema::new(&options));
        let sessions = Arc::new(LockSessions::new(max_sessions, session_settings.clone()));
        let watchers = Watchers::new(
            session_settings.clone(),
            options.max_wait_sessions,
            schema.clone(),
            sessions.clone(),
        );
        let sequence = schema.sequence.clone();
        Ok(PostgresBackend {
            inner: Arc::new(Backend {
                sessions,
                pooling,
                max_sessions,
                timeout,
                check_interval: options.check_interval,
                lock: format!(
                    "SELECT nextval('{sequence}') FROM \
                 (SELECT pg_try_advisory_lock($1) AS ok OFFSET 0) s WHERE ok"
                ),
                lock_shared: format!(
                    "SELECT nextval('{sequence}') FROM \
                 (SELECT pg_try_advisory_lock_shared($1) AS ok OFFSET 0) s WHERE ok"
                ),
                lock_shared_again: lock_shared_again_sql(&sequence),
                lock_slot: lock_slot_sql(&sequence),
                offsets: std::collections::hash_map::RandomState::new(),
                attempts: std::sync::atomic::AtomicU64::new(0),
                schema: schema.clone(),
                fencing_ready: AtomicBool::new(false),
                settings: session_settings,
                watchers,
            }),
        })
    }

    /// How many sessions are open now for locks (held locks and attempts share them); at most
    /// [`max_sessions`](PostgresOptions::max_sessions).
    pub fn open_sessions(&self) -> usize {
        self.inner.sessions.open()
    }

    /// How many sessions are open now to wake this process's waiters; at most
    /// [`max_wait_sessions`](PostgresOptions::max_wait_sessions).
    pub fn wait_sessions(&self) -> usize {
        self.inner.watchers.sessions()
    }

    /// Runs one statement on `session` under the statement timeout, classifying its failure
    /// for `stage`.
    fn run<'a, F: Future>(
        &'a self,
        stage: Stage,
        session: &'a Session,
        statement: F,
    ) -> Statement<'a, F> {
        Statement {
            bounded: session.bounded(self.inner.timeout, statement),
            stage,
            backend: self,
        }
    }

    /// Creates the fencing schema and sequence, and the watch function, unless they exist.
    async fn ensure_fencing(&self, session: &Session) -> Result<(), BackendError> {
        let client = session.client();
        let schema = &self.inner.schema;
        // Checking first lets a role without CREATE use objects an administrator made:
        // CREATE SCHEMA checks the privilege before IF NOT EXISTS.
        let row = self
            .run(
                Stage::Attempt,
                session,
                client.query_one(&schema.exists, &[]),
            )
            .await?;
        let (Ok(sequence), Ok(function)) = (row.try_get::<_, bool>(0), row.try_get::<_, bool>(1))
        else {
            return Err(BackendError::permanent(
                "unexpected answer to the fencing check",
            ));
        };
        if !sequence {
            self.run(Stage::Attempt, session, client.batch_execute(&schema.setup))
                .await?;
        } else if !function {
            // Locks work without it; only the server's log pays (see `schema`).
            let created = self
                .run(
                    Stage::Attempt,
                    session,
                    client.batch_execute(&schema.setup_function),
                )
                .await;
            if let Err(error) = created {
                tracing::warn!(
                    target: "lockingkit",
                    error = %error,
                    "the PostgreSQL watch function {} is missing or from an older version, and \
                     could not be created; locks work, but without it each waiting process's \
                     watcher makes the server log two errors a second, and with the older one a \
                     wait that ends keeps its request queued until its slice ends (create it \
                     with lockingkit::providers::postgres::setup_sql)",
                    schema.watch_function
                );
            }
        }
        self.inner.fencing_ready.store(true, Ordering::Release);
        Ok(())
    }

    /// Prepares an attempt on a reserved session: the fencing objects, the lock statement.
    /// Nothing here can take a lock.
    async fn prepare_attempt(
        &self,
        session: &Session,
        which: Prepared,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, BackendError> {
        if !self.inner.fencing_ready.load(Ordering::Acquire) {
            // Boxed: it runs once per backend, and inline it would enlarge every attempt.
            Box::pin(self.ensure_fencing(session)).await?;
        }
        self.run(Stage::Attempt, session, session.statement(which, sql))
            .await
    }

    /// Where a semaphore attempt starts looking for a free slot: spread over the slots, so
    /// processes that want the same semaphore at once do not all try slot 0 first.
    fn slot_offset(&self, max_count: u16) -> i32 {
        use std::hash::BuildHasher;
        let attempt = self.inner.attempts.fetch_add(1, Ordering::Relaxed);
        let spread = self.inner.offsets.hash_one(attempt) % u64::from(max_count.max(1));
        i32::try_from(spread).unwrap_or(0)
    }

    /// The statement that takes a lock for `attempt`; `again` when the session already reads the
    /// key (the statement then looks for a queued writer first).
    fn lock_statement(&self, attempt: Attempt, again: bool) -> (Prepared, &str) {
        let inner = &*self.inner;
        match attempt {
            Attempt::Exclusive(_) => (Prepared::Lock, &inner.lock),
            Attempt::Shared(_) if again => (Prepared::LockSharedAgain, &inner.lock_shared_again),
            Attempt::Shared(_) => (Prepared::LockShared, &inner.lock_shared),
            Attempt::Semaphore { .. } => (Prepared::LockSlot, &inner.lock_slot),
        }
    }

    /// The lease of a lock the server granted this process's watcher of the key for a wait
    /// (see `waiting`): taken without a round trip, and nothing lies between the server's
    /// grant and this take for another client to slip into.
    fn adopted_lease(
        &self,
        advisory_key: i64,
        claimed: waiting::Claimed,
    ) -> Acquired<PostgresLease> {
        Acquired {
            lease: PostgresLease {
                advisory_key,
                hold: claimed.hold,
                session: claimed.session,
                _adopted: Some(claimed.adopted),
                released: AtomicBool::new(false),
                timeout: self.inner.timeout,
            },
            fencing_token: claimed.fencing_token,
        }
    }

    /// An exclusive or shared attempt at `advisory_key` (a wait's, when no watcher serves it).
    async fn attempt_mode(
        &self,
        advisory_key: i64,
        mode: LockMode,
    ) -> Result<Option<Acquired<PostgresLease>>, BackendError> {
        let attempt = match mode {
            LockMode::Shared => Attempt::Shared(advisory_key),
            _ => Attempt::Exclusive(advisory_key),
        };
        self.attempt(attempt, advisory_key).await
    }

    /// One attempt: reserves it on a session, sends its statement, and reads the answer.
    async fn attempt(
        &self,
        attempt: Attempt,
        advisory_key: i64,
    ) -> Result<Option<Acquired<PostgresLease>>, BackendError> {
        self.inner.pooling.refuse_if_found()?;
        // What an ended wait left on the key (a grant nobody took, a request being withdrawn)
        // is gone before the server is asked, so it cannot answer this attempt "busy".
        self.inner.watchers.settled(advisory_key).await;
        let Some(reservation) = self.inner.sessions.reserve(attempt).await? else {
            // This process holds the key, or may still: on every session it could try.
            return Ok(None);
        };
        let session = reservation.session();
        let (which, sql) = self.lock_statement(attempt, reservation.again());
        let statement = match self.prepare_attempt(session, which, sql).await {
            Ok(statement) => statement,
            Err(error) => {
                reservation.free();
                return Err(error);
            }
        };
        let key_params: [&(dyn ToSql + Sync); 1] = [&advisory_key];
        let (semaphore, count, offset, known);
        let slot_params: [&(dyn ToSql + Sync); 4];
        let params: &[&(dyn ToSql + Sync)] = match attempt {
            Attempt::Semaphore { key, max_count } => {
                (semaphore, count, offset) =
                    (key, i32::from(max_count), self.slot_offset(max_count));
                known = session.slots_of(key);
                slot_params = [&semaphore, &count, &offset, &known];
                &slot_params
            }
            Attempt::Exclusive(_) | Attempt::Shared(_) => &key_params,
        };
        // From here until the answer is read, any exit (no answer in time, this future being
        // dropped) leaves the key possibly held: the reservation's drop settles it.
        let row = match self
            .run(
                Stage::Attempt,
                session,
                session.client().query_opt(&statement, params),
            )
            .await
        {
            Ok(row) => row,
            Err(error) if error.reached() => {
                // The server answered with an error; the lock may have been taken before it.
                reservation.failed();
                return Err(error);
            }
            Err(error) => return Err(error),
        };
        let Some(row) = row else {
            reservation.free();
            return Ok(None);
        };
        let Some((hold, fencing_token)) = taken(attempt, &row) else {
            reservation.failed();
            return Err(BackendError::permanent(
                "unexpected answer to the lock statement",
            ));
        };
        let session = reservation.hold(hold);
        Ok(Some(Acquired {
            lease: PostgresLease {
                advisory_key,
                hold,
                session,
                _adopted: None,
                released: AtomicBool::new(false),
                timeout: self.inner.timeout,
            },
            fencing_token,
        }))
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("max_sessions", &self.inner.max_sessions)
            .field("query_timeout", &self.inner.timeout)
            .field("check_interval", &self.inner.check_interval)
            .finish_non_exhaustive()
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // Every clone is gone, and every lease with it (a lease keeps its engine, and so its
        // backend, alive).
        self.sessions.close_all();
    }
}

impl LockBackend for PostgresBackend {
    type Lease = PostgresLease;

    fn provider(&self) -> &str {
        PROVIDER
    }

    fn timing(&self) -> LeaseTiming {
        LeaseTiming::ConnectionHeld(self.inner.check_interval)
    }

    /// Exclusive and shared locks, and semaphores of 1 to [`MAX_SEMAPHORE_COUNT`] slots: a busy
    /// semaphore attempt tries every slot in its one statement (a few microseconds each in the
    /// server's lock table), and slot numbers stay far below the fencing setup lock's, which
    /// shares the two-`int4` lock space.
    fn supports(&self, mode: LockMode) -> bool {
        mode.with_semaphores_up_to(MAX_SEMAPHORE_COUNT)
    }

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<PostgresLease>>, BackendError> {
        let advisory_key = PostgresLockKeys::advisory_key(key);
        let attempt = match mode {
            LockMode::Exclusive => Attempt::Exclusive(advisory_key),
            LockMode::Shared => Attempt::Shared(advisory_key),
            LockMode::Semaphore { max_count } => {
                let max_count = u16::try_from(max_count)
                    .ok()
                    .filter(|n| (1..=MAX_SEMAPHORE_COUNT).contains(&u32::from(*n)));
                let Some(max_count) = max_count else {
                    return Err(BackendError::misconfigured(format!(
                        "a PostgreSQL semaphore has 1 to {MAX_SEMAPHORE_COUNT} slots"
                    )));
                };
                // The high half of the advisory key (see `PostgresLockKeys::semaphore_key`).
                let key = (advisory_key >> 32) as i32;
                Attempt::Semaphore { key, max_count }
            }
        };
        self.attempt(attempt, advisory_key).await
    }

    async fn renew(&self, lease: &PostgresLease) -> Result<(), BackendError> {
        let session = &lease.session;
        if session.is_closed() || lease.released.load(Ordering::Acquire) {
            return Err(BackendError::lease_gone(
                "the lock's PostgreSQL session ended",
            ));
        }
        // One check per session per interval vouches for every lock on it.
        let timeout = self.inner.timeout.min(self.inner.check_interval);
        if session.check(self.inner.check_interval, timeout).await {
            Ok(())
        } else if self.inner.pooling.found() {
            Err(BackendError::lease_gone(
                "the lock's PostgreSQL session moved to another server process: a transaction- or statement-mode pooler hands it to other clients",
            ))
        } else {
            Err(BackendError::lease_gone(
                "the lock's PostgreSQL session failed its check",
            ))
        }
    }

    async fn release(&self, lease: &PostgresLease) -> Result<(), BackendError> {
        if lease.released.swap(true, Ordering::AcqRel) {
            return Err(BackendError::lease_gone("the lock was already released"));
        }
        let session = &lease.session;
        if session.is_closed() {
            return Err(BackendError::lease_gone(
                "the lock's PostgreSQL session ended",
            ));
        }
        // Until the unlock's answer is read, any exit leaves the key possibly held.
        let unlocking = Unlocking {
            session,
            hold: lease.hold,
            timeout: self.inner.timeout,
            answered: false,
            settled: false,
        };
        let (which, sql, key, slot) = match lease.hold {
            Advisory::Exclusive(key) => (Prepared::Unlock, UNLOCK, key, None),
            Advisory::Shared(key) => (Prepared::UnlockShared, UNLOCK_SHARED, key, None),
            Advisory::Slot(semaphore, slot) => (
                Prepared::UnlockSlot,
                UNLOCK_SLOT,
                i64::from(semaphore),
                Some((semaphore, slot)),
            ),
        };
        let statement = self
            .run(Stage::Release, session, session.statement(which, sql))
            .await?;
        let slot_params: [&(dyn ToSql + Sync); 2];
        let key_params: [&(dyn ToSql + Sync); 1] = [&key];
        let params: &[&(dyn ToSql + Sync)] = match &slot {
            Some((semaphore, slot)) => {
                slot_params = [semaphore, slot];
                &slot_params
            }
            None => &key_params,
        };
        let row = self
            .run(
                Stage::Release,
                session,
                session.client().query_one(&statement, params),
            )
            .await;
        let row = match row {
            Ok(row) => row,
            Err(error) => {
                let mut unlocking = unlocking;
                unlocking.answered = error.reached();
                return Err(error);
            }
        };
        // Either answer means this session no longer holds the key.
        unlocking.settle();
        match row.try_get::<_, bool>(0) {
            Ok(true) => Ok(()),
            _ => Err(BackendError::lease_gone(
                "PostgreSQL says the session no longer held the lock",
            )),
        }
    }

    /// Plain locks and readers: the key's watcher serves the wait (see `waiting`); a
    /// semaphore's wait polls.
    fn wait(
        self: Arc<Self>,
        key: &str,
        mode: LockMode,
    ) -> impl crate::backend::Wait<Lease = Self::Lease> + use<> {
        waiting::PostgresWait::open(self, key, mode)
    }

    /// One throwaway session of its own (not one of the lock sessions): connects and
    /// authenticates, checks the fencing sequence and the watch function, creating them if
    /// missing and allowed, and closes. Two or three round trips after the connect; no lock.
    async fn verify(&self) -> Result<(), BackendError> {
        let session = Box::pin(self.inner.settings.open_unthrottled()).await?;
        let checked = Box::pin(self.ensure_fencing(&session)).await;
        session.close();
        checked
    }

    /// Closes every lock session and watcher. Called once the engine has released its locks;
    /// clones of this backend lose their sessions too.
    async fn shutdown(&self) {
        self.inner.watchers.stop();
        self.inner.sessions.close_all();
    }

    fn lease_ended(&self, lease: &PostgresLease) -> impl Future<Output = ()> + Send {
        lease.session.ended().clone().cancelled_owned()
    }
}

/// An unlock on its way. Dropped unsettled (no answer in time, an error, the caller gone), the
/// key is left possibly held, and the session settles it (see [`Session::release_unconfirmed`]).
struct Unlocking<'a> {
    session: &'a Arc<Session>,
    hold: Advisory,
    timeout: Duration,
    answered: bool,
    settled: bool,
}

impl Unlocking<'_> {
    fn settle(mut self) {
        self.settled = true;
        self.session.released(self.hold);
        self.session.after_release();
    }
}

impl Drop for Unlocking<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.session
                .release_unconfirmed(self.hold, self.timeout, self.answered);
        }
    }
}

pin_project_lite::pin_project! {
    /// One statement under the statement timeout (see [`PostgresBackend::run`]). Written out
    /// rather than as an `async fn`, which would keep the statement's future twice (the
    /// argument, and the value it awaits): every attempt and release is moved into a box per
    /// call, so its size costs on every lock.
    #[must_use = "a statement does nothing until it is awaited"]
    struct Statement<'a, F> {
        #[pin]
        bounded: Bounded<'a, F>,
        stage: Stage,
        backend: &'a PostgresBackend,
    }
}

impl<T, F: Future<Output = Result<T, tokio_postgres::Error>>> Future for Statement<'_, F> {
    type Output = Result<T, BackendError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        Poll::Ready(match std::task::ready!(this.bounded.poll(cx)) {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(error)) => {
                if errors::is_missing_object(&error) {
                    this.backend
                        .inner
                        .fencing_ready
                        .store(false, Ordering::Release);
                }
                Err(errors::query_error(error, *this.stage))
            }
            Err(_) => Err(errors::timed_out(*this.stage, this.backend.inner.timeout)),
        })
    }
}

/// Connection settings a lock session needs, where the connection string leaves them open.
fn tune_connection(config: &mut tokio_postgres::Config, connect_timeout: Duration) {
    // A vanished peer is noticed by keepalive probes within about a minute instead of the
    // kernel's two hours; settings from the connection string win.
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
        config.connect_timeout(connect_timeout);
    }
    // Lets an operator find lock sessions in pg_stat_activity.
    if config.get_application_name().is_none() {
        config.application_name("lockingkit");
    }
}

/// A reader's statement on a session that reads the key already. The server grants a session a
/// shared lock it holds without looking at the queue, so a queued writer (see `waiting`) would
/// not hold this reader back: it looks for one first. Only this path pays for that, as
/// `pg_locks` takes every lock-table partition.
fn lock_shared_again_sql(sequence: &str) -> String {
    format!(
        "SELECT nextval('{sequence}') FROM (SELECT pg_try_advisory_lock_shared($1) AS ok \
         FROM (SELECT WHERE NOT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' \
         AND objsubid = 1 AND NOT granted AND mode = 'ExclusiveLock' \
         AND classid = (($1 >> 32) & 4294967295)::oid AND objid = ($1 & 4294967295)::oid \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))) w \
         OFFSET 0) s WHERE ok"
    )
}

/// A semaphore attempt in one round trip: slots are tried from `$3` on, skipping those this
/// session holds (`$4`; the server would grant them again by re-entrancy), until one is taken;
/// the LIMIT stops the scan there, so one attempt never takes two slots. CASE fixes the order:
/// the planner may reorder plain AND-ed conditions.
fn lock_slot_sql(sequence: &str) -> String {
    format!(
        "SELECT slot, nextval('{sequence}') FROM (SELECT slot \
         FROM (SELECT (i + $3) % $2 AS slot FROM generate_series(0, $2 - 1) i) c \
         WHERE CASE WHEN slot = ANY($4) THEN false ELSE pg_try_advisory_lock($1, slot) END \
         LIMIT 1) taken"
    )
}

/// What a lock statement's row says was taken: the advisory lock and its fencing token, or
/// `None` for an answer the statement cannot give.
fn taken(attempt: Attempt, row: &tokio_postgres::Row) -> Option<(Advisory, u64)> {
    let (hold, token) = match attempt {
        Attempt::Exclusive(key) => (Advisory::Exclusive(key), row.try_get::<_, i64>(0).ok()?),
        Attempt::Shared(key) => (Advisory::Shared(key), row.try_get::<_, i64>(0).ok()?),
        Attempt::Semaphore { key, max_count } => {
            let slot = row.try_get::<_, i32>(0).ok()?;
            if !(0..i32::from(max_count)).contains(&slot) {
                return None;
            }
            (Advisory::Slot(key, slot), row.try_get::<_, i64>(1).ok()?)
        }
    };
    Some((hold, u64::try_from(token).ok()?))
}

/// A held PostgreSQL advisory lock: the key and the shared session that holds it.
///
/// Dropping a lease that was not released unlocks its key in the background (or, if no other
/// lock depends on the session, closes it), so the server never keeps the lock.
pub struct PostgresLease {
    advisory_key: i64,
    hold: Advisory,
    session: Arc<Session>,
    /// For a lock the server granted a waiting session (see `waiting`): that session, which
    /// goes back to wait for other keys once this lease (and its `session` above, dropped
    /// first) is gone.
    _adopted: Option<waiting::Adopted>,
    released: AtomicBool,
    timeout: Duration,
}

impl PostgresLease {
    /// The advisory key of the lock's key, as `pg_locks` shows it (`classid` high and `objid`
    /// low 32 bits, `objsubid = 1`). For a semaphore, that of its name: the slot held is
    /// [`semaphore_slot`](Self::semaphore_slot).
    pub fn advisory_key(&self) -> i64 {
        self.advisory_key
    }

    /// For a semaphore, the two-`int4` advisory lock of the slot held (semaphore key, slot), as
    /// `pg_locks` shows it (`classid`, `objid`, `objsubid = 2`); see
    /// [`PostgresLockKeys::semaphore_slot`](crate::keys::PostgresLockKeys::semaphore_slot).
    pub fn semaphore_slot(&self) -> Option<(i32, i32)> {
        match self.hold {
            Advisory::Slot(semaphore, slot) => Some((semaphore, slot)),
            Advisory::Exclusive(_) | Advisory::Shared(_) => None,
        }
    }
}

impl fmt::Debug for PostgresLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresLease").finish_non_exhaustive()
    }
}

impl Drop for PostgresLease {
    fn drop(&mut self) {
        if !self.released.load(Ordering::Acquire) && !self.session.is_closed() {
            self.session
                .release_unconfirmed(self.hold, self.timeout, false);
        }
    }
}
