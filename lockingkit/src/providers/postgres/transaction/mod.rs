//! Transaction-scoped locks: advisory locks taken inside a transaction the caller owns, held
//! until it ends.
//!
//! The session provider ([`PostgresBackend`](super::PostgresBackend)) keeps its own sessions and
//! hands out [`LockHandle`](crate::LockHandle)s that the engine keeps and releases. These locks
//! are the other shape: `pg_try_advisory_xact_lock(k)` (or `_shared`) on the caller's own
//! transaction, with the same key mapping ([`PostgresLockKeys::advisory_key`]) and the fencing
//! token from the same sequence in the same round trip. PostgreSQL releases them at COMMIT or
//! ROLLBACK, and there is no unlock: nothing of LockingKit's runs while they are held.

mod lockable;
mod options;
mod statement;
mod wait;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::Client;

pub use lockable::LockableTransaction;
pub use options::PostgresTransactionOptions;

use super::errors::{self, Stage};
use super::keys::PostgresLockKeys;
use super::schema::Schema;
use crate::background::within;
use crate::backoff::Backoff;
use crate::error::{ErrorKind, LockError};
use crate::keys::validate_key;
use statement::Answer;

/// Locks that live inside a transaction you own: taken on it, released by its COMMIT or
/// ROLLBACK.
///
/// Make one value at startup and share it (clones are cheap); each call takes the transaction
/// to lock in, any [`LockableTransaction`]: a tokio-postgres [`Transaction`], or with the
/// `deadpool` feature a [`deadpool_postgres::Transaction`] as it is. Await the lock (and check
/// it was taken) before sending the statements it guards: tokio-postgres pipelines statements
/// sent concurrently on one connection, and one sent alongside the attempt would run whether
/// or not the lock was granted.
///
/// ```no_run
/// use std::time::Duration;
/// use lockingkit::providers::postgres::PostgresTransactionLocks;
///
/// # #[cfg(feature = "deadpool")]
/// # async fn ship(pool: &deadpool_postgres::Pool, locks: &PostgresTransactionLocks)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// let mut client = pool.get().await?;
/// // Once at startup, unless a PostgresBackend or a migration made the sequence already.
/// locks.create_fencing_sequence(&client).await?;
/// let transaction = client.transaction().await?;
/// // Held from here until COMMIT or ROLLBACK; waits up to 5 s for another holder.
/// let lock = locks.acquire(&transaction, "orders/42", Duration::from_secs(5)).await?;
/// transaction
///     .execute(
///         "UPDATE orders SET shipped = true, fence = $2 WHERE id = $1",
///         &[&42_i64, &i64::try_from(lock.fencing_token())?],
///     )
///     .await?;
/// transaction.commit().await?; // the lock is released with the commit
/// # Ok(()) }
/// ```
///
/// # Before the first lock: the fencing sequence
/// Each attempt takes its fencing token from the fencing sequence in the same round trip, and
/// never creates it inside your transaction, so the sequence must exist in the database first.
/// It does once a [`PostgresBackend`](super::PostgresBackend) (same schema and sequence names)
/// has been used on that database, or once an administrator has run
/// [`setup_sql`](super::setup_sql). An application that takes only transaction locks calls
/// [`create_fencing_sequence`](Self::create_fencing_sequence) once at startup (safe to run
/// again), or runs `setup_sql` in a migration if its role may not create objects. Without the
/// sequence every attempt is [`ErrorKind::Misconfigured`], naming these fixes, and your
/// transaction stays usable.
///
/// # Prepared or unnamed
/// On a tokio-postgres [`Transaction`] each attempt is one unnamed statement, which the server
/// parses and plans every time and which leaves nothing on the server session. On a
/// deadpool-postgres `Transaction` (the `deadpool` feature) the statement is prepared once per
/// connection through the pool's statement cache, and each attempt only binds and executes it:
/// cheaper for the server, but behind a transaction-mode pooler it needs one that carries
/// prepared statements across server sessions (PgBouncer 1.21 or later with
/// `max_prepared_statements` set); otherwise an attempt fails with
/// [`ErrorKind::Misconfigured`] (SQLSTATE 26000). Pass `&*transaction`, the tokio-postgres
/// transaction it wraps, to send unnamed statements from a deadpool-postgres transaction.
///
/// # What these locks are
/// - **Held until the transaction ends**, and only then: there is no unlock, no renewal and no
///   background task. ROLLBACK (or dropping the transaction, which rolls it back) releases them
///   as COMMIT does. Taken inside a savepoint (a nested `Transaction`), a lock is released by
///   rolling back to that savepoint too; a released savepoint passes it to the enclosing
///   transaction.
/// - **Lost** only with the transaction: if its connection ends (the server or network goes
///   away, `pg_terminate_backend`), the server aborts the transaction, which releases the lock,
///   and the transaction's next statement fails. No write made under the lock can commit after
///   that, so the transaction's own COMMIT is the proof that the lock was held throughout.
/// - **The same locks as the session provider's**: a key held by a [`DistributedLock`] on a
///   [`PostgresBackend`](super::PostgresBackend) is busy here and the other way round, readers
///   ([`try_read`](Self::try_read), [`read`](Self::read)) share with every reader, and fencing
///   tokens come from the same sequence, so they grow across both APIs.
/// - **READ COMMITTED only**: under REPEATABLE READ or SERIALIZABLE a transaction reads from
///   a snapshot taken no later than the lock statement, so before the grant, and the lock
///   would not protect its reads. Such a transaction is refused with
///   [`ErrorKind::Misconfigured`] naming its isolation level, in the same round trip and
///   before the try-lock: nothing is taken and the transaction stays usable.
/// - **Reentrant within one transaction**, as PostgreSQL's locks are: a transaction that holds
///   a key is granted it again (with a new, larger token); it never excludes itself.
/// - **Through PgBouncer in transaction mode**: the pooler keeps your transaction on one server
///   session until it ends (for the prepared form, see above). Statement mode allows no
///   transactions at all.
///
/// # Waiting
/// [`acquire`](Self::acquire) and [`read`](Self::read) never wait in one long statement, which
/// would keep the transaction's snapshot (and write an ERROR to the server log each time a
/// `lock_timeout` ended it): they retry the try-lock with the engine's capped, jittered
/// backoff ([`min_retry_delay`](PostgresTransactionOptions::min_retry_delay) doubling to
/// [`max_retry_delay`](PostgresTransactionOptions::max_retry_delay)) until the timeout. A wait
/// that is still busy at its deadline is [`ErrorKind::Timeout`]. Such a writer is not queued in
/// the server, so unlike a session writer it does not hold new readers back.
///
/// # Failures
/// Every statement is bounded by [`query_timeout`](PostgresTransactionOptions::query_timeout),
/// and a wait's statements also by the time left until its deadline plus 250 ms: a server that
/// stops answering ends a wait that soon after its timeout, with [`ErrorKind::Unavailable`].
/// A failure other than busy, timeout or the isolation refusal leaves the transaction in a
/// state only ending it settles: a statement the server failed has aborted it (as any failed
/// statement does), and a statement that did not answer in time, or whose call was dropped,
/// may still take the lock in it. Roll it back. Failures are [`ErrorKind::Unavailable`] (no
/// answer, the connection ended, a server failure a retry may cure),
/// [`ErrorKind::Misconfigured`] (no fencing sequence, a read-only transaction, an isolation
/// level above READ COMMITTED, a missing permission) or [`ErrorKind::Backend`] (an aborted
/// transaction), each with its cause.
///
/// [`DistributedLock`]: crate::DistributedLock
/// [`Transaction`]: tokio_postgres::Transaction
/// [`deadpool_postgres::Transaction`]: https://docs.rs/deadpool-postgres/0.14/deadpool_postgres/struct.Transaction.html
#[derive(Clone)]
pub struct PostgresTransactionLocks {
    inner: Arc<Statements>,
}

/// The statements of one [`PostgresTransactionLocks`], with the fencing sequence spliced in.
struct Statements {
    lock: String,
    lock_shared: String,
    /// `schema.sequence`, for messages.
    sequence: String,
    /// The fencing objects, and how to create them.
    schema: Schema,
    options: PostgresTransactionOptions,
}

/// A lock held by a transaction until it ends: what [`PostgresTransactionLocks`] returns.
///
/// It is a receipt, not a handle: the lock belongs to the transaction, dropping this value
/// releases nothing, and nothing here can tell whether the transaction has ended since.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct PostgresTransactionLock {
    fencing_token: u64,
    advisory_key: i64,
    shared: bool,
}

impl PostgresTransactionLock {
    /// The fencing token: greater than every token handed out before it from the same sequence,
    /// by either API. Send it with every write the lock guards.
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// The advisory key, as `pg_locks` shows it (`classid` high and `objid` low 32 bits,
    /// `objsubid = 1`).
    pub fn advisory_key(&self) -> i64 {
        self.advisory_key
    }

    /// Whether this is a reader's shared hold.
    pub fn is_shared(&self) -> bool {
        self.shared
    }
}

impl fmt::Debug for PostgresTransactionLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The advisory key is a hash of the lock key, which may carry customer data.
        f.debug_struct("PostgresTransactionLock")
            .field("fencing_token", &self.fencing_token)
            .field("shared", &self.shared)
            .finish_non_exhaustive()
    }
}

/// What an attempt asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Exclusive,
    Shared,
}

impl Default for PostgresTransactionLocks {
    /// Locks with the default options: the session provider's default sequence,
    /// `lockingkit.fencing_tokens`.
    fn default() -> Self {
        Self::build(PostgresTransactionOptions::default())
    }
}

impl PostgresTransactionLocks {
    /// Validates `options`; fails with [`ErrorKind::Misconfigured`], listing every problem.
    /// Opens nothing: every call runs on the transaction it is given.
    pub fn new(options: PostgresTransactionOptions) -> Result<Self, LockError> {
        let problems = options.problems();
        if !problems.is_empty() {
            return Err(crate::config::misconfigured_at(
                "PostgresTransactionOptions",
                problems,
            ));
        }
        Ok(Self::build(options))
    }

    fn build(options: PostgresTransactionOptions) -> Self {
        let schema = Schema::named(&options.fencing_schema, &options.fencing_sequence);
        let sequence = schema.sequence.clone();
        let lock = |function: &str| statement::lock_sql(function, &sequence);
        PostgresTransactionLocks {
            inner: Arc::new(Statements {
                lock: lock("pg_try_advisory_xact_lock"),
                lock_shared: lock("pg_try_advisory_xact_lock_shared"),
                schema,
                sequence,
                options,
            }),
        }
    }

    /// The options these locks were made with.
    pub fn options(&self) -> &PostgresTransactionOptions {
        &self.inner.options
    }

    /// Takes `key` exclusively in `transaction` if nobody else holds it: one statement.
    ///
    /// [`ErrorKind::Busy`] when another transaction or session holds it (or a reader does);
    /// [`ErrorKind::InvalidKey`] for an empty key or one over 512 characters.
    pub async fn try_acquire(
        &self,
        transaction: &impl LockableTransaction,
        key: &str,
    ) -> Result<PostgresTransactionLock, LockError> {
        self.try_in(transaction, key, Mode::Exclusive).await
    }

    /// Takes `key` exclusively in `transaction`, waiting up to `timeout` for its holders to
    /// let go (`Duration::MAX` waits as long as it takes; see *Waiting* above).
    pub async fn acquire(
        &self,
        transaction: &impl LockableTransaction,
        key: &str,
        timeout: Duration,
    ) -> Result<PostgresTransactionLock, LockError> {
        self.wait_in(transaction, key, Mode::Exclusive, timeout)
            .await
    }

    /// Takes `key` shared in `transaction` unless a writer holds it: readers exclude writers,
    /// never each other. A writer of the session provider that waits for the key is queued in
    /// the server, and holds this reader back too.
    pub async fn try_read(
        &self,
        transaction: &impl LockableTransaction,
        key: &str,
    ) -> Result<PostgresTransactionLock, LockError> {
        self.try_in(transaction, key, Mode::Shared).await
    }

    /// Takes `key` shared in `transaction`, waiting up to `timeout` for writers.
    pub async fn read(
        &self,
        transaction: &impl LockableTransaction,
        key: &str,
        timeout: Duration,
    ) -> Result<PostgresTransactionLock, LockError> {
        self.wait_in(transaction, key, Mode::Shared, timeout).await
    }

    /// Creates the fencing schema and sequence (and the session provider's watch function)
    /// unless they exist, on `client` outside any transaction of yours: what a
    /// [`PostgresBackend`](super::PostgresBackend) does on first use.
    ///
    /// Needed once per database when nothing else made the sequence: no `PostgresBackend` with
    /// the same names has run on it and no migration ran [`setup_sql`](super::setup_sql) (see
    /// [Before the first lock](Self#before-the-first-lock-the-fencing-sequence)). Run it at
    /// startup or in a migration; it is safe to run again. Without the sequence, every attempt
    /// in that database is [`ErrorKind::Misconfigured`] rather than create it inside your
    /// transaction.
    pub async fn create_fencing_sequence(&self, client: &Client) -> Result<(), LockError> {
        let timeout = self.inner.options.query_timeout;
        match within(timeout, client.batch_execute(&self.inner.schema.setup)).await {
            Some(Ok(())) => Ok(()),
            Some(Err(error)) => Err(failure(error)),
            None => Err(no_answer(timeout)),
        }
    }

    async fn try_in(
        &self,
        transaction: &impl LockableTransaction,
        key: &str,
        mode: Mode,
    ) -> Result<PostgresTransactionLock, LockError> {
        validate_key(key)?;
        let advisory_key = PostgresLockKeys::advisory_key(key);
        let bound = self.inner.options.query_timeout;
        self.attempt(transaction, advisory_key, mode, bound)
            .await?
            .ok_or_else(LockError::busy)
    }

    async fn wait_in(
        &self,
        transaction: &impl LockableTransaction,
        key: &str,
        mode: Mode,
        timeout: Duration,
    ) -> Result<PostgresTransactionLock, LockError> {
        validate_key(key)?;
        let advisory_key = PostgresLockKeys::advisory_key(key);
        let options = &self.inner.options;
        let delays = Backoff::new(options.min_retry_delay, options.max_retry_delay);
        wait::until_taken(timeout, options.query_timeout, delays, |bound| {
            self.attempt(transaction, advisory_key, mode, bound)
        })
        .await
    }

    /// One try-lock with its fencing token, unanswered after `timeout`; `None` when busy.
    async fn attempt(
        &self,
        transaction: &impl LockableTransaction,
        advisory_key: i64,
        mode: Mode,
        timeout: Duration,
    ) -> Result<Option<PostgresTransactionLock>, LockError> {
        let inner = &*self.inner;
        let sql = match mode {
            Mode::Exclusive => &inner.lock,
            Mode::Shared => &inner.lock_shared,
        };
        let statement = transaction.lock_row(sql, &advisory_key);
        let row = match within(timeout, statement).await {
            None => return Err(no_answer(timeout)),
            Some(Err(error)) => return Err(failure(error)),
            Some(Ok(row)) => row,
        };
        let answer = row.try_get::<_, i64>(0).ok().and_then(statement::read);
        match answer {
            Some(Answer::Taken(fencing_token)) => Ok(Some(PostgresTransactionLock {
                fencing_token,
                advisory_key,
                shared: mode == Mode::Shared,
            })),
            Some(Answer::Busy) => Ok(None),
            Some(Answer::Refused(level)) => Err(statement::refused(level)),
            Some(Answer::NoSequence) => Err(statement::no_sequence(&inner.sequence)),
            None => Err(LockError::new(
                ErrorKind::Backend,
                "unexpected answer to the lock statement; the transaction may hold the lock until it ends",
            )),
        }
    }
}

impl fmt::Debug for PostgresTransactionLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresTransactionLocks")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

/// A statement that did not answer within `timeout`.
fn no_answer(timeout: Duration) -> LockError {
    LockError::new(
        ErrorKind::Unavailable,
        format!(
            "PostgreSQL did not answer within {timeout:?}; the statement may still take the lock in the transaction: roll it back"
        ),
    )
}

/// What a failed statement in the caller's transaction means.
fn failure(error: tokio_postgres::Error) -> LockError {
    let sqlstate = error.code().map(|c| c.code().to_owned());
    match sqlstate.as_deref() {
        // The caller's transaction failed before this call: nothing runs in it any more.
        Some("25P02") => LockError::new(
            ErrorKind::Backend,
            "the transaction is aborted (SQLSTATE 25P02): an earlier statement in it failed; roll it back",
        ),
        // A READ ONLY transaction, or a standby: the token is a nextval, which writes.
        Some("25006") => LockError::new(
            ErrorKind::Misconfigured,
            "the transaction is read-only (SQLSTATE 25006): a fencing token needs nextval; take the lock in a read-write transaction on the primary",
        ),
        // Only the prepared path (a deadpool-postgres transaction) names a statement.
        Some("26000") => LockError::new(
            ErrorKind::Misconfigured,
            "the server session does not know the lock statement this connection prepared (SQLSTATE 26000): a pooler in transaction mode ran the transaction on another server session, and it does not carry prepared statements across them (PgBouncer before 1.21 or without max_prepared_statements); configure it to, or lock in the tokio-postgres transaction it wraps (&*transaction), whose statements are unnamed; roll the transaction back",
        ),
        _ => errors::query_error(error, Stage::Attempt).into_lock_error(),
    }
}
