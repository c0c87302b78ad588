//! The MySQL and MariaDB provider: user-level named locks (`feature = "mysql"`).
//!
//! A lock is `GET_LOCK(name, 0)` on one of a few server sessions that the backend's locks
//! share, where `name` is [`MysqlLockKeys::lock_name`] of the key; semaphores take slot names
//! of their own. The lock lives exactly as long as that session holds it: it is declared lost
//! the moment the session ends (killed, a server that stopped or crashed, a statement that did
//! not answer in time), and the session is checked every
//! [`check_interval`](MysqlOptions::check_interval).
//!
//! # Guarantees and caveats
//! - **Locks share sessions**: at most [`max_sessions`](MysqlOptions::max_sessions) per
//!   backend, each holding any number of locks (MySQL 5.7+ and MariaDB 10.0.2+ allow many
//!   named locks per session). A session runs one statement at a time, so attempts, releases
//!   and checks take turns on it and spread over the sessions.
//! - **Never by re-entrancy**: named locks are reentrant within a session, so a session never
//!   asks for a name it holds; it answers busy instead, as the server would answer any other
//!   session.
//! - **A statement that does not finish ends its session**: no answer within
//!   [`query_timeout`](MysqlOptions::query_timeout), a broken connection or a cancelled
//!   statement leaves the connection's state unknown, so it is closed, the server frees every
//!   lock it held, and every holder on it is told of the loss. Checks run in tasks of their own,
//!   so the engine's bound on a check does not cut one off; keep `release_timeout` longer than
//!   the statement timeout, so that it does not cut off an unlock.
//! - **Loss at once**: each session holds a marker lock that a sentinel connection waits for
//!   (see `sentinel`), so a session the server ends while idle (`KILL`, a restart) is loss
//!   within moments, not at the next check.
//! - **Fencing tokens** are `epoch × 2⁴⁷ + n`, drawn by the statement that takes the lock:
//!   `SELECT CASE GET_LOCK(?, 0) WHEN 1 THEN UUID_SHORT() WHEN 0 THEN 0 END`, where `n` is the
//!   server's `UUID_SHORT()` counter less the epoch's base. The statement reads no table and
//!   writes nothing, not even to the binary log. The epoch is a durable row in the InnoDB table
//!   `lockingkit_fencing`, moved on once per server start (a restart, a crash, a promoted
//!   replica), so tokens keep growing across all of them whatever the server's clock did
//!   (see `take`). The table is created on first use; a user without CREATE needs it created
//!   beforehand ([`setup_sql`]).
//! - **Semaphores**: slot `s` of the semaphore `k` is the name
//!   [`MysqlLockKeys::semaphore_slot`]`(k, s)`. One statement tries the free slots in turn, from
//!   a slot that differs from one attempt to the next on, and takes the first the server
//!   grants; a second draws the token. At most [`MAX_SEMAPHORE_COUNT`] slots.
//! - **No readers**: a named lock has no shared mode, and a reader-writer lock built from
//!   several names could not tell a waiting writer from a reader without a second round trip
//!   that races; the backend refuses `LockMode::Shared` (see the MySQL guide).
//! - **Not replicated**: named locks live in one server's memory. After a failover every lock
//!   is gone and every holder sees loss.

mod connection;
mod errors;
pub(crate) mod keys;
mod options;
mod provider;
mod sentinel;
mod session;
mod sessions;
mod take;
mod waiting;

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::Row;

pub use options::{MysqlOptions, DEFAULT_FENCING_TABLE};
pub(crate) use provider::Mysql;

use crate::backend::MAX_SEMAPHORE_COUNT;
use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend, LockMode};
use crate::config::Problem;
use crate::error::LockError;
use connection::Connector;
use errors::Stage;
use keys::MysqlLockKeys;
use session::Session;
use sessions::LockSessions;
use take::{Candidate, FencingSql, Missing, Taken};

/// The provider name in telemetry.
pub(crate) const PROVIDER: &str = "mysql";

/// The unlock; its answer is 1 when this session held the lock.
const UNLOCK: &str = "SELECT RELEASE_LOCK(?)";

/// The MySQL and MariaDB backend: a few lock sessions and the statements of the lock protocol.
///
/// ```no_run
/// use lockingkit::{DistributedLock, MysqlBackend, MysqlOptions};
///
/// # async fn run() -> Result<(), lockingkit::LockError> {
/// let backend = MysqlBackend::new(MysqlOptions::new(
///     "mysql://app:secret@db.internal:3306/app?require_ssl=true",
/// ))?;
/// let locks = DistributedLock::builder(backend).name("Jobs").build()?;
/// let handle = locks.try_acquire("jobs/nightly-export").await?;
/// // … work, sending handle.fencing_token() with every write …
/// handle.release().await?;
/// # Ok(()) }
/// ```
///
/// Clones share the sessions and the fencing state: two `DistributedLock`s built from clones
/// of one backend use one connection budget, and a key one of them holds is busy for the other.
#[derive(Clone)]
pub struct MysqlBackend {
    inner: Arc<Backend>,
}

/// What the clones of one [`MysqlBackend`] share.
struct Backend {
    connector: Arc<Connector>,
    sessions: Arc<LockSessions>,
    /// Wakes this process's waiters when their key is freed, granting it to them.
    watchers: Arc<waiting::Watchers>,
    max_sessions: usize,
    check_interval: Duration,
    fencing: Fencing,
    /// Spreads the first slot semaphore attempts try.
    attempts: AtomicU64,
}

/// The fencing-token table and the statements that use it.
struct Fencing {
    /// Set once the table is known to exist; cleared if a statement finds it gone.
    ready: AtomicBool,
    sql: Arc<FencingSql>,
}

impl MysqlBackend {
    /// Validates `options` and prepares the sessions. No connection is opened until the first
    /// attempt, so a server that is down at startup is reported by the attempts, as
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable), not here.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured), listing every
    /// problem, when the options are invalid.
    pub fn new(options: MysqlOptions) -> Result<Self, LockError> {
        Self::open(options)
            .map_err(|problems| crate::config::misconfigured_at("MysqlOptions", problems))
    }

    /// [`new`](Self::new), with the problems as data, for the registry to place in the
    /// section the options came from.
    pub(crate) fn open(options: MysqlOptions) -> Result<Self, Vec<Problem>> {
        let problems = options.problems();
        if !problems.is_empty() {
            return Err(problems);
        }
        let opts = connection::parse(options.connection_string.expose())
            .map_err(|problem| vec![Problem::detail("connection_string", problem)])?;
        let connector = Connector::new(opts, options.query_timeout, options.check_interval);
        let sessions = Arc::new(LockSessions::new(connector.clone(), options.max_sessions));
        let fencing = Fencing {
            ready: AtomicBool::new(false),
            sql: Arc::new(FencingSql::new(&options.fencing_table)),
        };
        let watchers = waiting::Watchers::new(
            connector.clone(),
            sessions.clone(),
            options.max_wait_sessions,
            fencing.sql.clone(),
        );
        Ok(MysqlBackend {
            inner: Arc::new(Backend {
                sessions,
                watchers,
                connector,
                max_sessions: options.max_sessions,
                check_interval: options.check_interval,
                fencing,
                attempts: AtomicU64::new(0),
            }),
        })
    }

    /// How many sessions are open now for locks (held locks and attempts share them); at most
    /// [`max_sessions`](MysqlOptions::max_sessions).
    pub fn open_sessions(&self) -> usize {
        self.inner.sessions.count()
    }

    /// How many sessions are open now to wait for keys held by other processes, or holding
    /// what such a wait was granted; at most [`max_wait_sessions`](MysqlOptions::max_wait_sessions).
    pub fn wait_sessions(&self) -> usize {
        self.inner.watchers.in_use()
    }

    /// Creates the fencing table and its epoch row unless they exist, and reads the row into
    /// `session` (as its first attempt would).
    async fn ensure_fencing(&self, session: &Arc<Session>) -> Result<(), BackendError> {
        let fencing = &self.inner.fencing;
        let (sql, reader) = (fencing.sql.clone(), session.clone());
        let missing = session
            .run(Stage::Attempt, move |conn| {
                Box::pin(take::ensure_fencing(conn, reader, sql))
            })
            .await?;
        if let Some(missing) = missing {
            return Err(unusable(missing));
        }
        fencing.ready.store(true, Ordering::Release);
        Ok(())
    }

    /// One attempt at the first of `names` the server grants. A session the server had closed
    /// while it sat idle (a restart, `KILL`, its idle timeout) is only found out by using it:
    /// the attempt then runs once more, on another session.
    async fn attempt(
        &self,
        names: Arc<[Candidate]>,
    ) -> Result<Option<Acquired<MysqlLease>>, BackendError> {
        if let [only] = &*names {
            // What an ended wait left on the name (a request being withdrawn, a grant nobody
            // took) is gone before the server is asked, so it cannot answer this "busy".
            self.inner.watchers.settled(&only.name).await;
        }
        let session = self.inner.sessions.pick().await?;
        match self.attempt_on(&session, names.clone()).await {
            // Ended under the attempt (closed as idle, or by the server): the server has freed
            // whatever the session held, so one more try elsewhere is safe.
            Err(_) if session.was_broken() || session.is_ended() => {
                let session = self.inner.sessions.pick().await?;
                self.attempt_on(&session, names).await
            }
            answer => answer,
        }
    }

    /// One attempt on `session`.
    async fn attempt_on(
        &self,
        session: &Arc<Session>,
        names: Arc<[Candidate]>,
    ) -> Result<Option<Acquired<MysqlLease>>, BackendError> {
        if !self.inner.fencing.ready.load(Ordering::Acquire) {
            // Boxed: it runs once per backend, and inline it would enlarge every attempt.
            Box::pin(self.ensure_fencing(session)).await?;
        }
        let (holder, sql, asked) = (
            session.clone(),
            self.inner.fencing.sql.clone(),
            names.clone(),
        );
        let taken = session
            .run(Stage::Attempt, move |conn| {
                Box::pin(take::take(conn, holder, asked, sql, 0))
            })
            .await;
        let (index, fencing_token) = match taken {
            Ok(Taken::Granted {
                index,
                fencing_token,
                ..
            }) => (index, fencing_token),
            Ok(Taken::Busy) => return Ok(None),
            Ok(Taken::Unusable(missing)) => {
                self.inner.fencing.ready.store(false, Ordering::Release);
                return Err(unusable(missing));
            }
            Err(error) => {
                if error.kind() == crate::backend::BackendErrorKind::Misconfigured {
                    // The table may have been dropped: look for it again next time.
                    self.inner.fencing.ready.store(false, Ordering::Release);
                }
                return Err(error);
            }
        };
        let Some(taken) = names.get(index) else {
            return Err(BackendError::permanent(
                "unexpected answer to the lock statement",
            ));
        };
        Ok(Some(Acquired {
            lease: MysqlLease {
                name: taken.name.clone(),
                slot: taken.slot,
                session: session.clone(),
                released: AtomicBool::new(false),
                _adopted: None,
            },
            fencing_token,
        }))
    }

    /// The names a semaphore attempt tries, from a slot that differs from one attempt to the
    /// next on, so processes that want the same semaphore at once do not all try slot 0 first.
    fn slot_names(&self, key: &str, max_count: u16) -> Arc<[Candidate]> {
        let attempt = self.inner.attempts.fetch_add(1, Ordering::Relaxed);
        let start = spread(attempt) % u64::from(max_count.max(1));
        let start = u16::try_from(start).unwrap_or(0);
        (0..max_count)
            .map(|i| {
                let slot = (start + i) % max_count;
                Candidate {
                    name: Arc::from(MysqlLockKeys::semaphore_slot(key, slot)),
                    slot: Some(slot),
                }
            })
            .collect()
    }
}

/// A well-mixed 64-bit value from a counter (splitmix64's finaliser).
fn spread(counter: u64) -> u64 {
    let mut z = counter.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The statement that creates the fencing table of `options` with its epoch row, for an
/// administrator to run where the application's user may not create tables. Grant the user
/// SELECT and UPDATE on it afterwards.
///
/// ```
/// use lockingkit::MysqlOptions;
/// use lockingkit::providers::mysql::setup_sql;
///
/// let sql = setup_sql(&MysqlOptions::new("mysql://app@db/app"));
/// assert!(sql.starts_with("CREATE TABLE `lockingkit_fencing`"));
/// assert!(sql.contains("ENGINE=InnoDB"));
/// ```
pub fn setup_sql(options: &MysqlOptions) -> String {
    FencingSql::new(&options.fencing_table).create()
}

/// The failure of a fencing epoch that cannot be read.
fn unusable(missing: Missing) -> BackendError {
    BackendError::misconfigured(match missing {
        Missing::Row => {
            "the MySQL fencing table has no epoch row (id = 1); it was deleted, and making it \
             again would start fencing tokens over: insert (id, epoch, server_id, started, base) \
             = (1, e, 0, 0, 0) with e above every epoch used, the highest token handed out \
             shifted right by 47 (see the MySQL guide)"
        }
        Missing::ServerStart => {
            "the MySQL server does not tell its start time (the Uptime status, from \
             information_schema.GLOBAL_STATUS or performance_schema.global_status), which \
             fencing tokens need: on MySQL 8 turn performance_schema on (the default)"
        }
    })
}

/// Unlocks `name` on `session`: `Ok(true)` when the session held it.
async fn unlock(session: Arc<Session>, name: Arc<str>) -> Result<bool, BackendError> {
    // Not in a task of its own, unlike a check: the engine finishes a release whose caller went
    // away (see `background`), and gives it `release_timeout` (10 s by default), longer than
    // the statement's own timeout; cut off before it answered, the unlock would end the
    // session and its other locks (the MySQL guide says to keep it so).
    let holder = session.clone();
    session
        .run(Stage::Release, move |conn| {
            Box::pin(async move {
                let row = conn
                    .exec_first::<Row, _, _>(UNLOCK, (name.as_ref(),))
                    .await?;
                // Whatever the answer, the session no longer holds the name.
                holder.names().remove(&name);
                Ok(take::first_number(row) == Some(1))
            })
        })
        .await
}

impl fmt::Debug for MysqlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MysqlBackend")
            .field("max_sessions", &self.inner.max_sessions)
            .field("query_timeout", &self.inner.connector.timeout)
            .field("check_interval", &self.inner.check_interval)
            .finish_non_exhaustive()
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // Every clone is gone, and every lease with it (a lease keeps its engine, and so its
        // backend, alive).
        self.watchers.stop();
        self.sessions.close_all();
    }
}

impl LockBackend for MysqlBackend {
    type Lease = MysqlLease;

    fn provider(&self) -> &str {
        PROVIDER
    }

    fn timing(&self) -> LeaseTiming {
        LeaseTiming::ConnectionHeld(self.inner.check_interval)
    }

    /// Exclusive locks, and semaphores of 1 to [`MAX_SEMAPHORE_COUNT`] slots; no readers (see
    /// the module docs).
    fn supports(&self, mode: LockMode) -> bool {
        match mode {
            LockMode::Exclusive => true,
            LockMode::Semaphore { max_count } => (1..=MAX_SEMAPHORE_COUNT).contains(&max_count),
            _ => false,
        }
    }

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<MysqlLease>>, BackendError> {
        let names: Arc<[Candidate]> =
            match mode {
                LockMode::Exclusive => Arc::new([Candidate {
                    name: Arc::from(MysqlLockKeys::lock_name(key)),
                    slot: None,
                }]),
                LockMode::Semaphore { max_count } => {
                    let max_count = u16::try_from(max_count)
                        .ok()
                        .filter(|n| (1..=MAX_SEMAPHORE_COUNT).contains(&u32::from(*n)));
                    let Some(max_count) = max_count else {
                        return Err(BackendError::misconfigured(format!(
                            "a MySQL semaphore has 1 to {MAX_SEMAPHORE_COUNT} slots"
                        )));
                    };
                    self.slot_names(key, max_count)
                }
                _ => return Err(BackendError::misconfigured(
                    "MySQL named locks have no shared mode: the mysql provider takes no readers",
                )),
            };
        self.attempt(names).await
    }

    async fn renew(&self, lease: &MysqlLease) -> Result<(), BackendError> {
        if lease.released.load(Ordering::Acquire) {
            return Err(BackendError::lease_gone("the lock was already released"));
        }
        lease.session.check(self.inner.check_interval).await
    }

    async fn release(&self, lease: &MysqlLease) -> Result<(), BackendError> {
        if lease.released.swap(true, Ordering::AcqRel) {
            return Err(BackendError::lease_gone("the lock was already released"));
        }
        let session = lease.session.clone();
        if session.is_ended() {
            return Err(BackendError::lease_gone("the lock's MySQL session ended"));
        }
        match unlock(session, lease.name.clone()).await? {
            true => Ok(()),
            false => Err(BackendError::lease_gone(
                "MySQL says the session no longer held the lock",
            )),
        }
    }

    /// One throwaway session of its own (not one of the lock sessions): connects and
    /// authenticates, checks the fencing table and its epoch row (creating them if missing and
    /// allowed), and closes. A few round trips after the connect; no lock.
    async fn verify(&self) -> Result<(), BackendError> {
        let conn = Box::pin(self.inner.connector.connect_unthrottled()).await?;
        let session = Arc::new(Session::with(conn, self.inner.connector.timeout));
        let checked = Box::pin(self.ensure_fencing(&session)).await;
        session.end();
        checked
    }

    /// Plain locks: the name's watcher serves the wait (see `waiting`); a semaphore's wait
    /// polls.
    fn wait(
        self: Arc<Self>,
        key: &str,
        mode: LockMode,
    ) -> impl crate::backend::Wait<Lease = Self::Lease> + use<> {
        waiting::MysqlWait::open(self, key, mode)
    }

    /// Closes every lock session and waiting session. Called once the engine has released
    /// its locks; clones of this backend lose their sessions too.
    async fn shutdown(&self) {
        self.inner.watchers.stop();
        self.inner.sessions.close_all();
    }

    fn lease_ended(&self, lease: &MysqlLease) -> impl std::future::Future<Output = ()> + Send {
        lease.session.ended().clone().cancelled_owned()
    }
}

/// A held MySQL named lock: its name and the shared session that holds it.
///
/// Dropping a lease that was not released unlocks its name in the background, so the server
/// never keeps the lock.
pub struct MysqlLease {
    name: Arc<str>,
    /// For a semaphore, the slot held.
    slot: Option<u16>,
    session: Arc<Session>,
    released: AtomicBool,
    /// For a lock the server granted a waiting session (see `waiting`): that session, which
    /// goes back to the pool once this lease (and its `session` above, dropped first) is gone.
    _adopted: Option<waiting::Adopted>,
}

impl MysqlLease {
    /// The lock name held, as `IS_USED_LOCK` takes it and `performance_schema.metadata_locks`
    /// shows it (see [`MysqlLockKeys`]).
    pub fn lock_name(&self) -> &str {
        &self.name
    }

    /// For a semaphore, the slot held.
    pub fn semaphore_slot(&self) -> Option<u16> {
        self.slot
    }

    /// The server's id of the session holding the lock (`CONNECTION_ID()` there, what
    /// `IS_USED_LOCK` answers and `KILL` takes).
    pub fn connection_id(&self) -> u32 {
        self.session.server_id()
    }
}

impl fmt::Debug for MysqlLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The name is derived from the key: never printed.
        f.debug_struct("MysqlLease").finish_non_exhaustive()
    }
}

impl Drop for MysqlLease {
    fn drop(&mut self) {
        if self.released.load(Ordering::Acquire) || self.session.is_ended() {
            return;
        }
        let (session, name) = (self.session.clone(), self.name.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                // A failed unlock ends the session, which frees the lock.
                runtime.spawn(async move {
                    let _ = unlock(session, name).await;
                });
            }
            // Without a runtime nothing can be sent: closing the session frees the lock.
            Err(_) => session.end(),
        }
    }
}
