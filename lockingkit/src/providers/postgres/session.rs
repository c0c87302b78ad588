//! One shared PostgreSQL session: a pipelined client, the advisory keys it holds, and a signal
//! when it ends.
//!
//! Many locks live on one session. tokio-postgres pipelines the statements that concurrent
//! callers send on one client, so attempts, unlocks and checks of different locks do not wait
//! for each other's round trips. What the session must get right is which locks it holds:
//! session advisory locks are reentrant, and one session's locks never conflict with each
//! other, so the server would grant this session anything it asks for again.
//!
//! - An exclusive key (a plain lock, a writer) or a semaphore slot is taken at most once per
//!   session, and never while the session holds the key in the other mode.
//! - A key may be held shared many times over (the server counts the holds, and each lease
//!   unlocks one); never exclusively at the same time.
//! - A semaphore attempt skips the slots the session holds, and at most one attempt per
//!   semaphore runs on a session at once, since which slot it takes is known only from its
//!   answer.
//! - What an attempt or unlock that did not answer may have left held is not taken on this
//!   session again until the server has said it is free (see [`Resolution`] for how each kind
//!   is settled).

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
use super::pooler::{Pooling, ServerProcess};
use crate::backend::BackendError;

/// The statements of the lock protocol, prepared once per session on first use.
#[derive(Clone, Copy, Debug)]
pub(super) enum Prepared {
    /// Try-lock with the fencing token in the same round trip.
    Lock,
    /// `pg_advisory_unlock($1)`.
    Unlock,
    /// Shared try-lock with the fencing token.
    LockShared,
    /// Shared try-lock on a session that already holds the key shared, which the server
    /// grants without looking at its queue: it first looks for a queued writer itself.
    LockSharedAgain,
    /// `pg_advisory_unlock_shared($1)`.
    UnlockShared,
    /// Takes one free slot of a semaphore, with its fencing token.
    LockSlot,
    /// `pg_advisory_unlock($1, $2)` of one slot.
    UnlockSlot,
    /// Unlocks every slot of a semaphore the session holds but no lease knows of.
    UnlockStraySlots,
    /// `pg_advisory_unlock($1)` if `pg_locks` shows the session holding `$1`.
    UnlockIfHeld,
    /// One `pg_advisory_unlock_shared($1)` if the session holds `$1` shared.
    UnlockSharedIfHeld,
    /// `pg_advisory_unlock($1, $2)` if the session holds that slot.
    UnlockSlotIfHeld,
}

impl Prepared {
    const COUNT: usize = 12;

    fn index_and_types(self) -> (usize, &'static [Type]) {
        const KEY: &[Type] = &[Type::INT8];
        match self {
            Prepared::Lock => (0, KEY),
            Prepared::Unlock => (1, KEY),
            // 2 was the session check's, which is sent unnamed now (see `run_check`).
            Prepared::LockShared => (3, KEY),
            Prepared::LockSharedAgain => (4, KEY),
            Prepared::UnlockShared => (5, KEY),
            Prepared::LockSlot => (6, &[Type::INT4, Type::INT4, Type::INT4, Type::INT4_ARRAY]),
            Prepared::UnlockSlot => (7, &[Type::INT4, Type::INT4]),
            Prepared::UnlockStraySlots => (8, &[Type::INT4, Type::INT4_ARRAY]),
            Prepared::UnlockIfHeld => (9, KEY),
            Prepared::UnlockSharedIfHeld => (10, KEY),
            Prepared::UnlockSlotIfHeld => (11, &[Type::INT4, Type::INT4]),
        }
    }
}

/// One advisory lock held for a lease, as the server names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Advisory {
    /// `pg_advisory_lock(bigint)`: a plain lock or a writer.
    Exclusive(i64),
    /// `pg_advisory_lock_shared(bigint)`: a reader. The server counts a session's shared holds
    /// of a key, and each lease unlocks once.
    Shared(i64),
    /// `pg_advisory_lock(int4, int4)`: one slot of a semaphore (semaphore key, slot).
    Slot(i32, i32),
}

impl Advisory {
    fn object(self) -> Object {
        match self {
            Advisory::Exclusive(key) | Advisory::Shared(key) => Object::Key(key),
            Advisory::Slot(semaphore, slot) => Object::Slot(semaphore, slot),
        }
    }
}

/// What one attempt asks the server for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Attempt {
    /// The key alone.
    Exclusive(i64),
    /// The key alongside other readers.
    Shared(i64),
    /// Any one slot of the semaphore `key` that nobody holds, among `0..max_count`.
    Semaphore { key: i32, max_count: u16 },
}

impl Attempt {
    fn object(self) -> Object {
        match self {
            Attempt::Exclusive(key) | Attempt::Shared(key) => Object::Key(key),
            Attempt::Semaphore { key, .. } => Object::Semaphore(key),
        }
    }

    fn shared(self) -> bool {
        matches!(self, Attempt::Shared(_))
    }
}

/// What the key map tracks: the server's lock objects, and semaphores being attempted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Object {
    /// The `bigint` lock of a key, exclusive or shared.
    Key(i64),
    /// One semaphore slot.
    Slot(i32, i32),
    /// A semaphore attempt in flight: which slot it takes is known only from its answer, so at
    /// most one attempt per semaphore runs on a session, and one that goes unanswered makes the
    /// whole semaphore unconfirmed on it.
    Semaphore(i32),
}

/// What a session knows about one lock object. An exclusive object has at most one attempt,
/// hold or unconfirmed outcome at a time; a shared key may have many of each, because the
/// server counts shared holds per session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Entry {
    shared: bool,
    /// Attempts on their way; their answers decide.
    attempting: u32,
    /// Holds for leases.
    held: u32,
    /// Holds the session may have: an attempt or unlock went unanswered. An unlock is retried
    /// until it answers; meanwhile the object is not taken on this session.
    unconfirmed: u32,
    /// For a semaphore attempt: the slots it may try.
    max_count: u16,
}

impl Entry {
    fn is_empty(&self) -> bool {
        self.attempting == 0 && self.held == 0 && self.unconfirmed == 0
    }
}

/// Whether a session may take an attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Availability {
    /// It has unlocks the server has not confirmed: it takes no new locks.
    Draining,
    /// It holds the key in another mode, may hold it, or is attempting it exclusively.
    HasKey,
    /// Another attempt on the same semaphore is on its way here.
    InFlight,
    /// It may take the shared attempt, and holds (or attempts) the key shared already.
    Again,
    /// It may take the attempt.
    Free,
}

/// One PostgreSQL session shared by many locks.
pub(super) struct Session {
    client: Client,
    ended: CancellationToken,
    statements: [OnceLock<Statement>; Prepared::COUNT],
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
    /// The server process the session was opened on, which every check's answer must name.
    server_process: ServerProcess,
    pooling: Arc<Pooling>,
}

#[derive(Default)]
struct Keys {
    by_object: HashMap<Object, Entry>,
    /// Holds for leases, over every object.
    held: usize,
    /// Unconfirmed outcomes, over every object.
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
        pooling: &Arc<Pooling>,
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
        let verified = pooling.verify_new_session(&client, config, tls, timeout);
        let server_process = match verified.await {
            Ok(process) => process,
            Err(error) => {
                driver.abort();
                return Err(error);
            }
        };
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
            server_process,
            pooling: pooling.clone(),
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

    /// Whether `attempt` may go here, in one look at the key map.
    pub(super) fn availability(&self, attempt: Attempt) -> Availability {
        let keys = self.keys();
        if keys.unconfirmed > 0 {
            return Availability::Draining;
        }
        match (keys.by_object.get(&attempt.object()), attempt) {
            (None, _) => Availability::Free,
            (Some(_), Attempt::Semaphore { .. }) => Availability::InFlight,
            (Some(entry), Attempt::Shared(_)) if entry.shared => Availability::Again,
            (Some(_), _) => Availability::HasKey,
        }
    }

    /// How many locks this session holds for leases.
    pub(super) fn held(&self) -> usize {
        self.keys().held
    }

    /// Reserves `attempt` on this session, unless [`availability`](Self::availability) says no
    /// meanwhile. `Some(true)`: a shared attempt on a key this session already holds or attempts
    /// shared.
    pub(super) fn reserve(&self, attempt: Attempt) -> Option<bool> {
        let mut keys = self.keys();
        let object = attempt.object();
        let entry = keys.by_object.entry(object).or_default();
        let again = !entry.is_empty();
        if again && !(attempt.shared() && entry.shared && entry.unconfirmed == 0) {
            return None;
        }
        entry.shared = attempt.shared();
        entry.attempting = entry.attempting.saturating_add(1);
        if let Attempt::Semaphore { max_count, .. } = attempt {
            entry.max_count = max_count;
        }
        Some(again)
    }

    /// Applies `change` to the entry of `object`, keeping the totals, and tells the session set
    /// when the session stops draining or a semaphore attempt ends (attempts of the same
    /// semaphore may be waiting for it).
    fn update(&self, object: Object, change: impl FnOnce(&mut Entry)) {
        let mut keys = self.keys();
        let keys = &mut *keys;
        let entry = keys.by_object.entry(object).or_default();
        let before = *entry;
        change(entry);
        let after = *entry;
        let (held, unconfirmed) = (
            keys.held.saturating_sub(before.held as usize),
            keys.unconfirmed.saturating_sub(before.unconfirmed as usize),
        );
        if after.is_empty() {
            keys.by_object.remove(&object);
        }
        keys.held = held.saturating_add(after.held as usize);
        keys.unconfirmed = unconfirmed.saturating_add(after.unconfirmed as usize);
        let drained = before.unconfirmed > after.unconfirmed && keys.unconfirmed == 0;
        let semaphore_done = matches!(object, Object::Semaphore(_)) && after.is_empty();
        if drained || semaphore_done {
            self.changed.notify_waiters();
        }
    }

    /// The server answered `attempt` busy.
    pub(super) fn attempt_busy(&self, attempt: Attempt) {
        self.update(attempt.object(), |entry| {
            entry.attempting = entry.attempting.saturating_sub(1)
        });
    }

    /// `attempt` took `hold` for a lease.
    pub(super) fn attempt_held(&self, attempt: Attempt, hold: Advisory) {
        if attempt.object() != hold.object() {
            // The slot first: until the semaphore's attempt is gone no other attempt of it runs
            // here, and after that every one sees the slot as this session's.
            self.update(hold.object(), |entry| {
                entry.held = entry.held.saturating_add(1)
            });
            self.update(attempt.object(), |entry| {
                entry.attempting = entry.attempting.saturating_sub(1)
            });
        } else {
            self.update(hold.object(), |entry| {
                entry.attempting = entry.attempting.saturating_sub(1);
                entry.held = entry.held.saturating_add(1);
            });
        }
    }

    /// The server confirmed the unlock of `hold`.
    pub(super) fn released(&self, hold: Advisory) {
        self.update(hold.object(), |entry| {
            entry.held = entry.held.saturating_sub(1)
        });
    }

    /// An attempt did not end cleanly: the session may hold what it asked for. See
    /// [`unconfirmed`](Self::unconfirmed).
    pub(super) fn attempt_unconfirmed(
        self: &Arc<Self>,
        attempt: Attempt,
        timeout: Duration,
        answered: bool,
    ) {
        self.update(attempt.object(), |entry| {
            entry.attempting = entry.attempting.saturating_sub(1);
            entry.unconfirmed = entry.unconfirmed.saturating_add(1);
        });
        self.unconfirmed(attempt.object(), timeout, answered);
    }

    /// The unlock of `hold` did not end cleanly (or its lease was dropped unreleased): the
    /// session may still hold it. See [`unconfirmed`](Self::unconfirmed).
    pub(super) fn release_unconfirmed(
        self: &Arc<Self>,
        hold: Advisory,
        timeout: Duration,
        answered: bool,
    ) {
        self.update(hold.object(), |entry| {
            entry.held = entry.held.saturating_sub(1);
            entry.unconfirmed = entry.unconfirmed.saturating_add(1);
        });
        self.unconfirmed(hold.object(), timeout, answered);
    }

    /// `object` may be held with no lease for it. The session takes no new locks until an
    /// unlock of it is answered, which is retried until it is.
    ///
    /// `answered` says the server answered (with an error): the session works, so the unlock
    /// follows at once. Otherwise (no answer in time, or the caller went away) the session is
    /// suspect: unless other locks depend on it, it closes, which frees the object at once.
    fn unconfirmed(self: &Arc<Self>, object: Object, timeout: Duration, answered: bool) {
        if !answered && self.held() == 0 {
            self.close();
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(resolve(self.clone(), object, timeout));
            }
            // No runtime drives the connection either; it ends with the runtime.
            Err(_) => self.close(),
        }
    }

    /// The slots of semaphore `key` this session holds or may hold, which an attempt must not
    /// take again (the server would grant them by re-entrancy).
    pub(super) fn slots_of(&self, key: i32) -> Vec<i32> {
        self.keys()
            .by_object
            .keys()
            .filter_map(|object| match *object {
                Object::Slot(semaphore, slot) if semaphore == key => Some(slot),
                _ => None,
            })
            .collect()
    }

    /// What the unlock of an unconfirmed `object` must do now.
    fn resolution(&self, object: Object) -> Resolution {
        let keys = self.keys();
        let Some(entry) = keys.by_object.get(&object).copied() else {
            return Resolution::Done;
        };
        match object {
            _ if entry.unconfirmed == 0 => Resolution::Done,
            Object::Key(_) if entry.shared && (entry.held > 0 || entry.attempting > 0) => {
                Resolution::Wait
            }
            Object::Key(key) if entry.shared => Resolution::SharedUntilFalse(key),
            Object::Key(key) => Resolution::Once(Advisory::Exclusive(key)),
            Object::Slot(semaphore, slot) => Resolution::Once(Advisory::Slot(semaphore, slot)),
            Object::Semaphore(semaphore) => Resolution::StraySlots(semaphore),
        }
    }

    /// The unconfirmed outcomes of `object` are settled: the session does not hold it.
    fn resolved(&self, object: Object, all: bool) {
        self.update(object, |entry| {
            entry.unconfirmed = if all {
                0
            } else {
                entry.unconfirmed.saturating_sub(1)
            };
        });
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
        let (index, types) = which.index_and_types();
        let slot = &self.statements[index];
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
    // Unnamed: its answer must come from whichever server process runs it, even behind a
    // pooler that would fail a prepared statement there (see `pooler`).
    let checked = session.client.query_typed_one(super::CHECK, &[]);
    let alive = match session.bounded(timeout, checked).await {
        Ok(Ok(row)) => session.pooling.same_process(session.server_process, &row),
        _ => false,
    };
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

/// How an unconfirmed object is settled.
#[derive(Clone, Copy, Debug)]
enum Resolution {
    /// Settled already (by another task, or the session closed).
    Done,
    /// Leases still hold the key shared on this session: a shared unlock now would take one of
    /// their holds away. Wait for them.
    Wait,
    /// One unlock; either answer settles it.
    Once(Advisory),
    /// Shared unlocks until the server says the session holds the key no more: it counts shared
    /// holds, and it is unknown how many went unanswered.
    SharedUntilFalse(i64),
    /// Unlocks every slot of the semaphore the session holds that no lease knows of: an
    /// unanswered attempt may have taken any one of them.
    StraySlots(i32),
}

impl Resolution {
    /// Sends the unlock; `true` when another is needed. Each unlocks only what `pg_locks`
    /// shows the session holding: the outcome that went unanswered may have left nothing held,
    /// and an unlock of a lock not held writes a WARNING into the server's log.
    async fn unlock(self, session: &Session) -> Result<bool, tokio_postgres::Error> {
        let client = &session.client;
        match self {
            Resolution::Done | Resolution::Wait => Ok(false),
            Resolution::Once(Advisory::Exclusive(key) | Advisory::Shared(key)) => {
                let statement = session
                    .statement(Prepared::UnlockIfHeld, super::UNLOCK_IF_HELD)
                    .await?;
                client.query(&statement, &[&key]).await.map(|_| false)
            }
            Resolution::Once(Advisory::Slot(semaphore, slot)) => {
                let statement = session
                    .statement(Prepared::UnlockSlotIfHeld, super::UNLOCK_SLOT_IF_HELD)
                    .await?;
                client
                    .query(&statement, &[&semaphore, &slot])
                    .await
                    .map(|_| false)
            }
            Resolution::SharedUntilFalse(key) => {
                let statement = session
                    .statement(Prepared::UnlockSharedIfHeld, super::UNLOCK_SHARED_IF_HELD)
                    .await?;
                // One row: a shared hold was given up, and there may be more.
                let rows = client.query(&statement, &[&key]).await?;
                Ok(!rows.is_empty())
            }
            Resolution::StraySlots(semaphore) => {
                let statement = session
                    .statement(Prepared::UnlockStraySlots, super::UNLOCK_STRAY_SLOTS)
                    .await?;
                let known = session.slots_of(semaphore);
                client
                    .query(&statement, &[&semaphore, &known])
                    .await
                    .map(|_| false)
            }
        }
    }
}

/// Retries the unlock of an unconfirmed `object` until the server answers it. An answer means
/// the session no longer holds it: statements on one session run in the order sent, so this
/// unlock runs after the attempt or unlock that went unanswered.
///
/// A session that leaves [`UNANSWERED_UNLOCKS`] retries in a row unanswered is broken, whatever
/// else depends on it: it closes, which frees every lock it holds (and is loss for them). The
/// session's checks would find the same, but only while some lock keeps checking it.
async fn resolve(session: Arc<Session>, object: Object, timeout: Duration) {
    let mut delay = Duration::from_millis(50);
    let mut unanswered = 0;
    loop {
        if session.is_closed() {
            return;
        }
        let resolution = session.resolution(object);
        match resolution {
            Resolution::Done => return,
            Resolution::Wait => {}
            _ => match session.bounded(timeout, resolution.unlock(&session)).await {
                Ok(Ok(true)) => continue,
                Ok(Ok(false)) => {
                    session.resolved(
                        object,
                        matches!(resolution, Resolution::SharedUntilFalse(_)),
                    );
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
            },
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
