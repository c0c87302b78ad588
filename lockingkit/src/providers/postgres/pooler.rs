//! Session pooling, verified: a pooler that shares server sessions between clients
//! (transaction or statement pooling: PgBouncer's `pool_mode = transaction` or `statement`,
//! and proxies like it) is refused before a session takes any lock, and a session found on
//! another server process later ends.
//!
//! # Why it must be found
//! A session advisory lock belongs to the server process (backend) that took it. Such a pooler
//! hands that backend to other clients between our statements, so a lock "held" here would be
//! granted to them too (session locks are reentrant), unlocked by them, or freed when the pooler
//! closes the backend, while this process still believes it holds it.
//!
//! # How, and what it costs
//! A backend is named by [`SERVER_PROCESS`]: `pg_backend_pid()` with
//! `pg_postmaster_start_time()`, since a process id can come again after a restart of a server
//! behind a pooler.
//! - **When a session opens**: the new session asks which process it is on. On a direct
//!   connection (or through a plain TCP proxy) its pid is the one in the cancel key the server
//!   sent at startup, read back without a round trip (see [`cancel_key_pid`]); a pooler issues
//!   cancel keys of its own, since it must route cancel requests itself. So a direct connection
//!   is verified by that one statement. Otherwise (and when the session requires TLS, which
//!   hides the key from this check) the session asks again while a second connection with the
//!   same settings opens, the second connection asks and closes, and the session asks a last
//!   time. Through session pooling the session keeps its backend and the second connection
//!   gets another (so the pooler needs a spare server connection for each session opening).
//!   A transaction- or statement-mode pooler returns the session's backend to the pool as soon
//!   as each statement ends. PgBouncer reuses the most recently released backend first (LIFO,
//!   its default), so the second connection gets the session's backend; with
//!   `server_round_robin = 1` it takes the least recently used one, so the session's second
//!   statement moves to another backend if one is idle, and the second connection gets the
//!   session's if none is. Any of these is refused with `Misconfigured`. All of it shares one
//!   deadline, the session's `query_timeout`. The probe cannot see the pooler when other
//!   clients' transactions take and give back backends at that very moment in just the order
//!   that hides it; the checks below cover that.
//! - **In every check**: the session check is [`SERVER_PROCESS`] instead of `SELECT 1` (the
//!   same round trip), sent unnamed so that it answers on whichever backend runs it. An answer
//!   from another process than at open means the session moved: it fails the check, which
//!   ends it (loss for every lock on it), a warning is logged once, and from then on the
//!   backend refuses every attempt and every session fails its next check. A moved session is
//!   proof of such a pooler: a direct connection has one backend for life. A pooler that lets
//!   other clients use the session's backend between its statements, yet always gives it back
//!   for the next one, is visible only to the probe at open.
//! - **Sticky**: once found, the pooler stays refused for the life of the backend (in practice,
//!   the process): no later answer could prove it gone, and a pooler reconfigured to session
//!   mode is one a restart picks up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, Config, Row};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::errors::{self, Stage};
use crate::backend::BackendError;

/// Asks which server process answers, and since when its server runs: a process id alone can
/// come again after a restart of a server behind a pooler, the pair cannot.
pub(super) const SERVER_PROCESS: &str = "SELECT pg_backend_pid(), pg_postmaster_start_time()";

/// One server process (backend) of one server run, as [`SERVER_PROCESS`] answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ServerProcess {
    pid: i32,
    server_started: SystemTime,
}

impl ServerProcess {
    /// The process a [`SERVER_PROCESS`] row names; `None` for any other row.
    fn read(row: &Row) -> Option<ServerProcess> {
        Some(ServerProcess {
            pid: row.try_get(0).ok()?,
            server_started: row.try_get(1).ok()?,
        })
    }
}

/// What a backend knows about a pooler in front of its server: set once a session was seen
/// on two server processes, or the probe at open found one shared. It stays set for the
/// backend's life: nothing a later session sees can prove the pooler gone.
#[derive(Debug, Default)]
pub(super) struct Pooling {
    found: AtomicBool,
}

/// The one error for a pooler that shares server sessions, naming the fixes.
fn refused() -> BackendError {
    BackendError::misconfigured(
        "PostgreSQL is reached through a connection pooler that shares server sessions between \
         clients (transaction or statement pooling: PgBouncer with pool_mode = transaction or \
         statement, or a proxy like it): it hands the server session, and every session lock on \
         it, to other clients between statements. Connect directly or through session pooling \
         (PgBouncer: pool_mode = session), or take transaction-scoped locks inside your own \
         transactions (PostgresTransactionLocks). This backend refuses every lock until the \
         process restarts",
    )
}

impl Pooling {
    /// Refuses every attempt once a pooler has been found.
    pub(super) fn refuse_if_found(&self) -> Result<(), BackendError> {
        if self.found() {
            Err(refused())
        } else {
            Ok(())
        }
    }

    /// Whether a pooler has been found.
    pub(super) fn found(&self) -> bool {
        self.found.load(Ordering::Acquire)
    }

    /// Checks a new session (`client`) for a pooler that shares server sessions, with a second
    /// connection made from `config` (see the module doc). The whole check, second connection
    /// included, is bounded by `timeout`; the second connection is closed before this returns.
    pub(super) async fn verify_new_session(
        &self,
        client: &Client,
        config: &Config,
        tls: &MakeRustlsConnect,
        timeout: Duration,
    ) -> Result<ServerProcess, BackendError> {
        self.refuse_if_found()?;
        let budget = Budget::new(timeout);
        let first = server_process(client, budget).await?;
        if cancel_key_pid(client, config, budget).await == Some(first.pid) {
            // The server's own cancel key reached us: nothing in between issues keys of its
            // own, as a pooler must, so nothing can lend this backend to other clients.
            return Ok(first);
        }
        // The probe connects while the session asks again; it asks only after that answer.
        let (second, probe) =
            tokio::join!(server_process(client, budget), connect(config, tls, budget));
        let (second, probe) = (second?, probe?);
        let other = match budget.within(ask(&probe)).await {
            Some(answer) => answer?,
            // Through session pooling, the second connection needs a server connection of
            // its own, which a full pool makes it wait for.
            None => {
                return Err(BackendError::unreachable(format!(
                    "the pooler check's second connection got no answer within {:?}: a pooler in \
                 session mode needs a spare server connection for each lock session that \
                 opens (PgBouncer: default_pool_size)",
                    budget.timeout
                )))
            }
        };
        drop(probe);
        let last = server_process(client, budget).await?;
        if other == first || second != first || last != first {
            self.found.store(true, Ordering::Release);
            return Err(refused());
        }
        Ok(first)
    }

    /// Whether a check's answer `row` comes from `opened_on`, the session's server process at
    /// open. Another process means a pooler moved the session: it is recorded (and logged
    /// once), and every session of the backend fails its next check.
    pub(super) fn same_process(&self, opened_on: ServerProcess, row: &Row) -> bool {
        let Some(answered) = ServerProcess::read(row) else {
            return false;
        };
        if answered != opened_on && !self.found.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                target: "lockingkit",
                "a PostgreSQL lock session's check was answered by another server process than \
                 the one it opened on, so a pooler moved it: its locks are lost, every other \
                 session fails its next check, and every attempt is refused: {}",
                refused().message()
            );
        }
        answered == opened_on && !self.found()
    }
}

/// The one deadline of a session's verification, and the budget it came from (for messages).
#[derive(Clone, Copy)]
struct Budget {
    deadline: Instant,
    timeout: Duration,
}

impl Budget {
    fn new(timeout: Duration) -> Self {
        Budget {
            deadline: crate::clock::in_(timeout),
            timeout,
        }
    }

    /// `future`, or `None` once the deadline has passed.
    async fn within<F: std::future::Future>(self, future: F) -> Option<F::Output> {
        tokio::time::timeout_at(self.deadline, future).await.ok()
    }
}

/// A second connection with the session's settings, its task driving it until it is dropped.
async fn connect(
    config: &Config,
    tls: &MakeRustlsConnect,
    budget: Budget,
) -> Result<Client, BackendError> {
    match budget.within(config.connect(tls.clone())).await {
        Some(Ok((client, connection))) => {
            // Dropping the task's handle does not stop it: it ends with the client.
            tokio::spawn(connection);
            Ok(client)
        }
        Some(Err(error)) => Err(errors::query_error(error, Stage::Connect)),
        None => Err(errors::timed_out(Stage::Connect, budget.timeout)),
    }
}

/// The process id in the cancel key `client` was given at startup: the server's own backend
/// pid on a direct connection (or through a plain TCP proxy), a key of the pooler's own
/// through PgBouncer, which must route cancel requests itself. tokio-postgres keeps the key
/// private, but writes it in a cancel request: one is written into memory and read back, never
/// sent. `None` when the session requires TLS (the request would negotiate it first), or when
/// the request is not what a cancel request looks like.
async fn cancel_key_pid(client: &Client, config: &Config, budget: Budget) -> Option<i32> {
    use tokio::io::AsyncReadExt;
    // CancelRequest: length 16, the request code 80877102, the process id, the secret key.
    const HEADER: [u8; 8] = [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e];
    if !matches!(config.get_ssl_mode(), SslMode::Disable | SslMode::Prefer) {
        return None;
    }
    let (mut ours, theirs) = tokio::io::duplex(64);
    let token = client.cancel_token();
    let read = async move {
        let mut request = [0u8; 16];
        let read = ours.read_exact(&mut request).await;
        // Our end closes once the request is read: whatever the writer does next (wait for
        // an answer, write more) ends there instead of waiting.
        drop(ours);
        read.ok().map(|_| request)
    };
    // Without TLS (which `NoTls` cannot do), the request is written as it is.
    let written = token.cancel_query_raw(theirs, tokio_postgres::NoTls);
    let (_, request) = budget.within(async { tokio::join!(written, read) }).await?;
    let request = request?;
    let (header, pid) = request.split_at(8);
    (header == HEADER).then(|| i32::from_be_bytes([pid[0], pid[1], pid[2], pid[3]]))
}

/// The server process that answers on `client`: one unnamed statement, which any pooler
/// passes on.
async fn server_process(client: &Client, budget: Budget) -> Result<ServerProcess, BackendError> {
    match budget.within(ask(client)).await {
        Some(answer) => answer,
        None => Err(errors::timed_out(Stage::Attempt, budget.timeout)),
    }
}

/// [`SERVER_PROCESS`] on `client`, unbounded.
async fn ask(client: &Client) -> Result<ServerProcess, BackendError> {
    match client.query_typed_one(SERVER_PROCESS, &[]).await {
        Ok(row) => ServerProcess::read(&row).ok_or_else(|| {
            BackendError::permanent("unexpected answer to the server process check")
        }),
        Err(error) => Err(errors::query_error(error, Stage::Attempt)),
    }
}
