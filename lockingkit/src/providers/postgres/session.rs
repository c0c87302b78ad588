//! One shared PostgreSQL session: a pipelined client, the advisory keys it holds, and a signal
//! when it ends.
//!
//! Many locks live on one session. tokio-postgres pipelines the statements that concurrent
//! callers send on one client, so attempts, unlocks and checks of different locks do not wait
//! for each other's round trips. What the session must get right is which keys it holds:
//! session advisory locks are reentrant, so a key is taken at most once per session, and a key
//! whose outcome is unknown (an attempt or unlock that did not answer) is not taken on this
//! session again until the server has said it is free.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::{Instant, Sleep};
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Config, Statement};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_util::sync::CancellationToken;

use super::errors::{self, Stage};
use crate::backend::BackendError;

/// The statements of the lock protocol, prepared once per session on first use.
#[derive(Clone, Copy, Debug)]
pub(super) enum Prepared {
    /// Try-lock with the fencing token in the same round trip.
    Lock,
    /// `pg_advisory_unlock($1)`.
    Unlock,
    /// `SELECT 1`, the session check.
    Check,
}

/// What a session knows about one advisory key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyState {
    /// An attempt is on its way; its answer decides.
    Attempting,
    /// The session holds the key for a lease.
    Held,
    /// The session may hold the key: an attempt or unlock went unanswered. An unlock is being
    /// retried; until it answers, the key is not taken on this session.
    Unconfirmed,
}

/// Whether a session may take an attempt on a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Availability {
    /// It has unlocks the server has not confirmed: it takes no new locks.
    Draining,
    /// It holds the key, may hold it, or is attempting it.
    HasKey,
    /// It may take the key.
    Free,
}

/// One PostgreSQL session shared by many locks.
pub(super) struct Session {
    client: Client,
    ended: CancellationToken,
    statements: [OnceLock<Statement>; 3],
    keys: Mutex<Keys>,
    /// Statements sent and not answered yet, to spread new attempts over sessions.
    in_flight: AtomicUsize,
    check: Mutex<CheckState>,
    /// The session set's notifier: told when this session stops draining, so attempts that
    /// found every session draining look again at once.
    changed: Arc<Notify>,
    /// A timer for statements that run alone, moved forward for each: pushing a registered
    /// timer later is an atomic update, while registering a fresh one per statement touches
    /// the timer wheel and, when no other timer is pending, wakes the runtime's driver (see
    /// the PostgreSQL rows of the benchmark, docs/performance.md). A statement sent while
    /// another holds it gets a timer of its own.
    solo_timer: Mutex<Pin<Box<Sleep>>>,
    solo_taken: AtomicBool,
    driver: JoinHandle<()>,
}

#[derive(Default)]
struct Keys {
    by_key: HashMap<i64, KeyState>,
    held: usize,
    unconfirmed: usize,
}

#[derive(Default)]
struct CheckState {
    /// When the newest successful check was sent.
    confirmed: Option<Instant>,
    /// The check in flight: `None` until it answers, then whether the session answered.
    running: Option<watch::Receiver<Option<bool>>>,
}

impl Session {
    /// Opens a session: connects within `timeout` and starts the task that drives it.
    pub(super) async fn open(
        config: &Config,
        tls: &MakeRustlsConnect,
        timeout: Duration,
        changed: Arc<Notify>,
    ) -> Result<Session, BackendError> {
        let connecting = config.connect(tls.clone());
        let (client, connection) = match within(timeout, connecting).await {
            Some(Ok(pair)) => pair,
            Some(Err(error)) => return Err(errors::query_error(error, Stage::Connect)),
            None => return Err(errors::timed_out(Stage::Connect, timeout)),
        };
        let ended = CancellationToken::new();
        let signal = ended.clone().drop_guard();
        let ended_notice = EndedNotice(changed.clone());
        let driver = tokio::spawn(async move {
            // Cancel `ended` and tell the set when the connection finishes or this task is
            // aborted: a session that ends frees its slot for attempts waiting on the set.
            // Dropped in reverse order: `ended` is cancelled before the set looks again.
            let _notice = ended_notice;
            let _signal = signal;
            let _ = connection.await;
        });
        Ok(Session {
            client,
            ended,
            statements: Default::default(),
            keys: Mutex::new(Keys::default()),
            in_flight: AtomicUsize::new(0),
            check: Mutex::new(CheckState::default()),
            changed,
            // Reset before every use; until then it only needs to be valid.
            solo_timer: Mutex::new(Box::pin(tokio::time::sleep(Duration::from_secs(3600)))),
            solo_taken: AtomicBool::new(false),
            driver,
        })
    }

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

    /// Ends the session: the socket closes and the server frees every lock it held.
    pub(super) fn close(&self) {
        self.driver.abort();
        self.ended.cancel();
    }

    /// Statements in flight on this session.
    pub(super) fn load(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn keys(&self) -> MutexGuard<'_, Keys> {
        // Every critical section leaves the map consistent.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether an attempt on `key` may go here, in one look at the key map.
    pub(super) fn availability(&self, key: i64) -> Availability {
        let keys = self.keys();
        if keys.unconfirmed > 0 {
            Availability::Draining
        } else if keys.by_key.contains_key(&key) {
            Availability::HasKey
        } else {
            Availability::Free
        }
    }

    /// How many locks this session holds for leases.
    pub(super) fn held(&self) -> usize {
        self.keys().held
    }

    /// Reserves `key` for an attempt, unless this session holds it or may hold it.
    pub(super) fn reserve(&self, key: i64) -> bool {
        let mut keys = self.keys();
        if keys.by_key.contains_key(&key) {
            return false;
        }
        keys.by_key.insert(key, KeyState::Attempting);
        true
    }

    /// Moves `key` to `to` (`None`: the server says this session does not hold it).
    fn set(&self, key: i64, to: Option<KeyState>) {
        let mut keys = self.keys();
        let from = match to {
            Some(state) => keys.by_key.insert(key, state),
            None => keys.by_key.remove(&key),
        };
        for (state, step) in [(from, -1), (to, 1)] {
            let counter = match state {
                Some(KeyState::Held) => &mut keys.held,
                Some(KeyState::Unconfirmed) => &mut keys.unconfirmed,
                _ => continue,
            };
            *counter = counter.saturating_add_signed(step);
        }
        let drained = from == Some(KeyState::Unconfirmed) && keys.unconfirmed == 0;
        drop(keys);
        if drained {
            self.changed.notify_waiters();
        }
    }

    /// The attempt took `key` for a lease.
    pub(super) fn mark_held(&self, key: i64) {
        self.set(key, Some(KeyState::Held));
    }

    /// The server says this session does not hold `key` (a busy attempt, a confirmed unlock).
    pub(super) fn mark_free(&self, key: i64) {
        self.set(key, None);
    }

    /// An attempt or unlock of `key` did not end cleanly: the session may hold it. It takes no
    /// new locks until an unlock of `key` is answered, which is retried until it is.
    ///
    /// `answered` says the server answered (with an error): the session works, so the unlock
    /// follows at once. Otherwise (no answer in time, or the caller went away) the session is
    /// suspect: unless other locks depend on it, it closes, which frees the key at once.
    pub(super) fn mark_unconfirmed(self: &Arc<Self>, key: i64, timeout: Duration, answered: bool) {
        self.set(key, Some(KeyState::Unconfirmed));
        if !answered && self.held() == 0 {
            self.close();
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(resolve(self.clone(), key, timeout));
            }
            // No runtime drives the connection either; it ends with the runtime.
            Err(_) => self.close(),
        }
    }

    /// A held lock was given up: if it was the last one a draining session kept open for, the
    /// session closes, which frees whatever it may still hold.
    pub(super) fn after_release(&self) {
        let keys = self.keys();
        if keys.unconfirmed > 0 && keys.held == 0 {
            drop(keys);
            self.close();
        }
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
        // Two callers may prepare at once; either statement serves.
        Ok(slot.get_or_init(|| statement).clone())
    }

    /// `statement`, failing with [`Elapsed`] if it does not finish within `timeout`, and
    /// counted as in flight meanwhile.
    pub(super) fn bounded<F: Future>(&self, timeout: Duration, statement: F) -> Bounded<'_, F> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Bounded {
            statement,
            timer: Timer::Unarmed(crate::clock::in_(timeout)),
            session: self,
        }
    }

    /// Checks that the session answers, at most once per `interval`: a check sent within the
    /// last `interval` vouches for every lock on the session, and callers that arrive while a
    /// check is in flight share its answer. A check that fails or does not answer within
    /// `timeout` ends the session, which is loss for every lock on it.
    pub(super) async fn check(self: &Arc<Self>, interval: Duration, timeout: Duration) -> bool {
        let mut running = {
            let mut state = self.check.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            if state
                .confirmed
                .is_some_and(|sent| now.saturating_duration_since(sent) < interval)
            {
                return true;
            }
            match &state.running {
                Some(running) => running.clone(),
                None => {
                    let (answer, running) = watch::channel(None);
                    state.running = Some(running.clone());
                    // In a task of its own, so that its answer is recorded even if every caller
                    // went away.
                    tokio::spawn(run_check(self.clone(), answer, now, timeout));
                    running
                }
            }
        };
        let alive = match running.wait_for(Option::is_some).await {
            Ok(answer) => *answer == Some(true),
            Err(_) => false,
        };
        alive
    }
}

async fn run_check(
    session: Arc<Session>,
    answer: watch::Sender<Option<bool>>,
    sent: Instant,
    timeout: Duration,
) {
    let checked = async {
        let statement = session.statement(Prepared::Check, super::CHECK).await?;
        session.client.query_one(&statement, &[]).await
    };
    let alive = matches!(session.bounded(timeout, checked).await, Ok(Ok(_)));
    {
        let mut state = session.check.lock().unwrap_or_else(PoisonError::into_inner);
        state.running = None;
        if alive {
            state.confirmed = Some(sent);
        }
    }
    if !alive {
        session.close();
    }
    answer.send_replace(Some(alive));
}

/// Retries the unlock of an unconfirmed `key` until the server answers it. Either answer means
/// the session no longer holds the key: statements on one session run in the order sent, so
/// this unlock runs after the attempt or unlock that went unanswered.
///
/// A session that leaves [`UNANSWERED_UNLOCKS`] retries in a row unanswered is broken, whatever
/// else depends on it: it closes, which frees every lock it holds (and is loss for them). The
/// session's checks would find the same, but only while some lock keeps checking it.
async fn resolve(session: Arc<Session>, key: i64, timeout: Duration) {
    let mut delay = Duration::from_millis(50);
    let mut unanswered = 0;
    loop {
        if session.is_closed() {
            return;
        }
        let unlock = async {
            let statement = session.statement(Prepared::Unlock, super::UNLOCK).await?;
            session.client.query_one(&statement, &[&key]).await
        };
        match session.bounded(timeout, unlock).await {
            Ok(Ok(_)) => {
                session.mark_free(key);
                return;
            }
            Ok(Err(error)) if error.is_closed() => return,
            // The server answered, with an error: try again.
            Ok(Err(_)) => unanswered = 0,
            Err(Elapsed) => {
                unanswered += 1;
                if unanswered >= UNANSWERED_UNLOCKS {
                    session.close();
                    return;
                }
            }
        }
        tokio::select! {
            _ = session.ended.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = delay
            .saturating_mul(2)
            .min(timeout.max(Duration::from_millis(50)));
    }
}

/// Unanswered unlock retries after which a session is closed as broken.
const UNANSWERED_UNLOCKS: u32 = 5;

/// Tells the session set, when dropped, that a session ended.
struct EndedNotice(Arc<Notify>);

impl Drop for EndedNotice {
    fn drop(&mut self) {
        self.0.notify_waiters();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Stops driving the connection: the socket closes and the server ends the session,
        // freeing any lock it held.
        self.driver.abort();
    }
}

/// A statement that did not answer in time.
#[derive(Debug)]
pub(super) struct Elapsed;

/// The deadline of one statement, armed once the statement is pending.
enum Timer {
    Unarmed(Instant),
    /// The session's solo timer, which this statement holds.
    Solo,
    Own(Pin<Box<Sleep>>),
}

pin_project_lite::pin_project! {
    /// A statement raced against its own deadline. The timer is armed only once the statement
    /// is pending, so a statement that answers on its first poll costs none.
    pub(super) struct Bounded<'a, F> {
        #[pin]
        statement: F,
        timer: Timer,
        session: &'a Session,
    }

    impl<'a, F> PinnedDrop for Bounded<'a, F> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if matches!(this.timer, Timer::Solo) {
                this.session.solo_taken.store(false, Ordering::Release);
            }
            this.session.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl<F: Future> Future for Bounded<'_, F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.statement.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        let session = *this.session;
        if let Timer::Unarmed(deadline) = *this.timer {
            *this.timer = if session
                .solo_taken
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                session
                    .solo_timer
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .as_mut()
                    .reset(deadline);
                Timer::Solo
            } else {
                Timer::Own(Box::pin(tokio::time::sleep_until(deadline)))
            };
        }
        let elapsed = match this.timer {
            Timer::Own(sleep) => sleep.as_mut().poll(cx).is_ready(),
            Timer::Solo => session
                .solo_timer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_mut()
                .poll(cx)
                .is_ready(),
            Timer::Unarmed(_) => false,
        };
        if elapsed {
            Poll::Ready(Err(Elapsed))
        } else {
            Poll::Pending
        }
    }
}

/// `future`, or `None` if it does not finish within `timeout`.
pub(super) async fn within<F: Future>(timeout: Duration, future: F) -> Option<F::Output> {
    tokio::time::timeout_at(crate::clock::in_(timeout), future)
        .await
        .ok()
}
