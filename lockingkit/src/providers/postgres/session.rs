//! Pooled PostgreSQL sessions: a client, its prepared statements, and a signal when it ends.
//!
//! deadpool-postgres's client hides the task that drives the connection, so nothing could
//! tell a held lock that its session ended until the next check asked the server. Here the
//! driving task cancels a token as it finishes, which lets the engine declare the loss within
//! moments of `pg_terminate_backend` or a server crash instead of up to a check interval later.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use deadpool::managed::{Manager, Metrics, RecycleError, RecycleResult};
use tokio::task::JoinHandle;
use tokio::time::{Instant, Sleep};
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Config, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

/// The statements of the lock protocol, prepared once per session on first use.
#[derive(Clone, Copy, Debug)]
pub(super) enum Prepared {
    /// Try-lock with the fencing token in the same round trip.
    Lock,
    /// `pg_advisory_unlock($1)`.
    Unlock,
    /// `SELECT 1`, the connection check.
    Check,
}

/// One PostgreSQL session.
pub(super) struct Session {
    client: Client,
    ended: CancellationToken,
    statements: [OnceLock<Statement>; 3],
    /// The deadline of the statement in flight. One timer per session, moved forward for each
    /// statement: pushing a registered timer later is an atomic update, while registering a
    /// fresh one per statement touches the timer wheel and, when no other timer is pending,
    /// wakes the runtime's driver — measured at 15–20 µs per statement here, a sixth of a
    /// loopback round trip.
    deadline: Mutex<Pin<Box<Sleep>>>,
    driver: JoinHandle<()>,
}

impl Session {
    pub(super) fn client(&self) -> &Client {
        &self.client
    }

    /// Cancelled once the session is over (closed by either side, or dropped).
    pub(super) fn ended(&self) -> &CancellationToken {
        &self.ended
    }

    pub(super) fn is_closed(&self) -> bool {
        self.ended.is_cancelled() || self.client.is_closed()
    }

    /// The prepared statement `which` (with text `sql`), preparing it on first use.
    pub(super) async fn statement(
        &self,
        which: Prepared,
        sql: &str,
    ) -> Result<Statement, tokio_postgres::Error> {
        let (slot, types): (_, &[Type]) = match which {
            Prepared::Lock => (&self.statements[0], &[Type::INT8]),
            Prepared::Unlock => (&self.statements[1], &[Type::INT8]),
            Prepared::Check => (&self.statements[2], &[]),
        };
        if let Some(statement) = slot.get() {
            return Ok(statement.clone());
        }
        // Boxed: preparing runs once per session, and inline its future would enlarge every
        // lock attempt and release (each is moved into a box per call).
        let statement = Box::pin(self.client.prepare_typed(sql, types)).await?;
        // A session serves one operation at a time, so no other preparation can race this one.
        let _ = slot.set(statement.clone());
        Ok(statement)
    }
}

impl Session {
    /// `statement`, failing with [`Elapsed`] if it does not finish within `timeout`.
    pub(super) fn bounded<F: Future>(&self, timeout: Duration, statement: F) -> Bounded<'_, F> {
        self.deadline
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
            .reset(Instant::now() + timeout);
        Bounded {
            statement,
            deadline: &self.deadline,
        }
    }
}

/// A statement that did not answer in time.
#[derive(Debug)]
pub(super) struct Elapsed;

pin_project_lite::pin_project! {
    /// A statement raced against its session's deadline.
    pub(super) struct Bounded<'a, F> {
        #[pin]
        statement: F,
        deadline: &'a Mutex<Pin<Box<Sleep>>>,
    }
}

impl<F: Future> Future for Bounded<'_, F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.statement.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        let mut deadline = this.deadline.lock().unwrap_or_else(PoisonError::into_inner);
        match deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Stops driving the connection: the socket closes and the server ends the session,
        // freeing any lock it held.
        self.driver.abort();
    }
}

/// Opens sessions for the pool.
pub(super) struct Connector {
    pub(super) config: Config,
    pub(super) tls: MakeRustlsConnect,
    /// The longest a connection may take to open, TLS and authentication included: a frozen
    /// server accepts the TCP connection (the kernel does) and then never answers.
    pub(super) timeout: Duration,
}

/// Why a session could not be opened.
#[derive(Debug)]
pub(super) enum ConnectError {
    /// The server or the network failed.
    Postgres(tokio_postgres::Error),
    /// Nothing answered in time.
    TimedOut,
}

impl Manager for Connector {
    type Type = Session;
    type Error = ConnectError;

    async fn create(&self) -> Result<Session, ConnectError> {
        // Boxed: connecting (TLS handshake included) is a future of many kilobytes, and unboxed
        // it would sit inside every checkout's future, to be copied on every lock attempt,
        // though a connection is opened only rarely.
        Box::pin(self.open()).await
    }

    async fn recycle(&self, session: &mut Session, _: &Metrics) -> RecycleResult<ConnectError> {
        // Sessions come back only clean (see the provider docs), so a closed one is the only
        // kind to refuse; checking costs no round trip.
        if session.is_closed() {
            Err(RecycleError::message("the session has ended"))
        } else {
            Ok(())
        }
    }
}

impl Connector {
    /// Opens a session: connects within the timeout and starts the task that drives it.
    async fn open(&self) -> Result<Session, ConnectError> {
        let (client, connection) =
            tokio::time::timeout(self.timeout, self.config.connect(self.tls.clone()))
                .await
                .map_err(|_| ConnectError::TimedOut)?
                .map_err(ConnectError::Postgres)?;
        let ended = CancellationToken::new();
        let signal = ended.clone().drop_guard();
        let driver = tokio::spawn(async move {
            // Cancels `ended` when the connection finishes or this task is aborted.
            let _signal = signal;
            let _ = connection.await;
        });
        Ok(Session {
            client,
            ended,
            statements: Default::default(),
            // Set before every statement; until then it only needs to be valid.
            deadline: Mutex::new(Box::pin(tokio::time::sleep(Duration::from_secs(3600)))),
            driver,
        })
    }
}

/// The pool of sessions.
pub(super) type SessionPool = deadpool::managed::Pool<Connector>;
/// A session checked out of the pool.
pub(super) type PooledSession = deadpool::managed::Object<Connector>;
