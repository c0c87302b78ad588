//! The lock sessions: the bounded set of sessions a backend's locks share.
//!
//! This is not a pool: no session is ever handed to one caller. Every attempt, unlock and
//! check of every lock is sent on one of at most `max` open sessions, pipelined with the others,
//! so the connections a process uses do not grow with the locks it holds. Sessions open on
//! demand, one at a time: a new one only when every open one has [`PIPELINE_DEPTH`] statements
//! in flight, up to `max`. A session that ends leaves the set at once, and the next attempt
//! that needs one opens a replacement. While connecting fails, attempts that need a new
//! session are refused at once with the latest cause (see `reconnect`), so a server that is
//! down or refuses our password sees one connect at a time, ever less often.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use super::session::{Advisory, Attempt, Availability, Session, SessionSettings};
use crate::backend::BackendError;

/// Statements in flight on every open session before another one opens. Statements that
/// queue on one session reach the server in fewer packets and cost it less per lock; past
/// this depth a further session spreads the work over another server process. 32 kept the
/// HTTP row of the benchmark on one session with the best requests/s, while 256 busy tasks
/// still spread over four (the fleet rows of docs/performance.md compare depths 1 to 64).
const PIPELINE_DEPTH: usize = 32;

/// The sessions that hold a backend's locks (waiting sessions are `waiting`'s).
pub(super) struct LockSessions {
    slots: Mutex<Slots>,
    /// Woken when a session opens, fails to open, or stops draining.
    changed: Arc<Notify>,
    max: usize,
    timeout: Duration,
    settings: Arc<SessionSettings>,
}

#[derive(Default)]
struct Slots {
    open: Vec<Arc<Session>>,
    connecting: usize,
}

/// What to do after looking at the set.
enum Step {
    Use(Reservation),
    Connect,
    /// This process holds (or may still hold) the key on every session it may use.
    HeldHere,
    /// No session can take the attempt, and connecting is failing: this is why.
    Failing(BackendError),
    Wait,
}

impl LockSessions {
    pub(super) fn new(max: usize, settings: Arc<SessionSettings>) -> Self {
        LockSessions {
            slots: Mutex::new(Slots::default()),
            changed: Arc::new(Notify::new()),
            max,
            timeout: settings.timeout,
            settings,
        }
    }

    fn slots(&self) -> MutexGuard<'_, Slots> {
        // Every critical section leaves the slots consistent.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sessions open now.
    pub(super) fn open(&self) -> usize {
        let mut slots = self.slots();
        slots.open.retain(|s| !s.is_closed());
        slots.open.len()
    }

    /// The least loaded open session, for a statement that takes no lock and holds nothing
    /// (withdrawing a waiting session's request); `None` when none is open.
    pub(super) fn least_loaded(&self) -> Option<Arc<Session>> {
        let mut slots = self.slots();
        slots.open.retain(|s| !s.is_closed());
        slots.open.iter().min_by_key(|s| s.load()).cloned()
    }

    /// Reserves `attempt` on a session where the server's answer can be trusted: one that
    /// neither holds the key nor may hold it (or, for a shared attempt, holds it only shared;
    /// for a semaphore, has no other attempt on it in flight), the least loaded open one, or a
    /// new one while every open one is busy and the set has room. `None`: this process holds the
    /// key (or may still hold it) on every session it could use.
    pub(super) async fn reserve(
        &self,
        attempt: Attempt,
    ) -> Result<Option<Reservation>, BackendError> {
        let give_up = crate::clock::in_(self.timeout);
        loop {
            let changed = self.changed.notified();
            match self.look(attempt) {
                Step::Use(reservation) => return Ok(Some(reservation)),
                Step::HeldHere => return Ok(None),
                Step::Failing(cause) => return Err(cause.paced_by_provider()),
                Step::Connect => return self.connect(attempt).await.map(Some),
                Step::Wait => {
                    if tokio::time::timeout_at(give_up, changed).await.is_err() {
                        return Err(BackendError::unreachable(format!(
                            "every PostgreSQL session of this backend waited {:?} for the server to confirm an unlock",
                            self.timeout
                        )));
                    }
                }
            }
        }
    }

    fn look(&self, attempt: Attempt) -> Step {
        let mut slots = self.slots();
        slots.open.retain(|s| !s.is_closed());
        // One session opens at a time, and only when every open one is busy: a burst of
        // attempts at startup waits for the first session instead of opening them all, and
        // statements batch on few sessions, which costs the server less per lock.
        let room = slots.connecting == 0 && slots.open.len() < self.max;
        // Ranked by (holds the key shared already, load): a reader goes to a session that
        // does not hold its key before it stacks on one that does, which costs a look at the
        // server's lock queue (see `Prepared::LockSharedAgain`).
        let mut best: Option<(bool, &Arc<Session>)> = None;
        let mut holds_key = false;
        for session in &slots.open {
            let again = match session.availability(attempt) {
                Availability::Draining | Availability::InFlight => continue,
                Availability::HasKey => {
                    holds_key = true;
                    continue;
                }
                Availability::Again => true,
                Availability::Free => false,
            };
            if best.is_none_or(|(b_again, b)| (again, session.load()) < (b_again, b.load())) {
                best = Some((again, session));
            }
        }
        match best {
            Some((again, session)) if !room || (!again && session.load() < PIPELINE_DEPTH) => {
                let session = session.clone();
                if let Some(again) = session.reserve(attempt) {
                    Step::Use(Reservation::new(session, attempt, again, self.timeout))
                } else {
                    Step::HeldHere
                }
            }
            _ if room => {
                slots.connecting += 1;
                Step::Connect
            }
            None if holds_key && slots.connecting == 0 && slots.open.len() >= self.max => {
                Step::HeldHere
            }
            // A session is opening while connecting fails: that one connect is the probe, and
            // whoever else needs a session is told the latest cause now.
            None => match self.settings.reconnect.current_failure() {
                Some(cause) => Step::Failing(cause),
                None => Step::Wait,
            },
            // A session is opening, or every one is draining.
            _ => Step::Wait,
        }
    }

    async fn connect(&self, attempt: Attempt) -> Result<Reservation, BackendError> {
        /// Gives the slot back if the connect fails or its caller goes away.
        struct Connecting<'a>(&'a LockSessions);
        impl Drop for Connecting<'_> {
            fn drop(&mut self) {
                let mut slots = self.0.slots();
                slots.connecting = slots.connecting.saturating_sub(1);
                drop(slots);
                self.0.changed.notify_waiters();
            }
        }
        let connecting = Connecting(self);
        // Boxed: connecting (TLS handshake included) is a future of many kilobytes, and inline
        // it would enlarge every attempt's future, though a session opens only rarely.
        let session = Box::pin(self.settings.open(self.changed.clone())).await?;
        let session = Arc::new(session);
        // A new session holds nothing, so the key is free on it.
        session.reserve(attempt);
        self.slots().open.push(session.clone());
        drop(connecting);
        Ok(Reservation::new(session, attempt, false, self.timeout))
    }

    /// Closes every session; their locks are lost.
    pub(super) fn close_all(&self) {
        for session in self.slots().open.drain(..) {
            session.close();
        }
    }
}

/// An attempt reserved on a session. Dropped before the attempt's answer was read, what it
/// asked for is treated as possibly held (see [`Session::attempt_unconfirmed`]).
pub(super) struct Reservation {
    session: Arc<Session>,
    attempt: Attempt,
    again: bool,
    timeout: Duration,
    settled: bool,
}

impl Reservation {
    fn new(session: Arc<Session>, attempt: Attempt, again: bool, timeout: Duration) -> Self {
        Reservation {
            session,
            attempt,
            again,
            timeout,
            settled: false,
        }
    }

    pub(super) fn session(&self) -> &Session {
        &self.session
    }

    /// Whether this is a shared attempt on a key the session already holds (or attempts)
    /// shared.
    pub(super) fn again(&self) -> bool {
        self.again
    }

    /// The server says the session did not take it.
    pub(super) fn free(mut self) {
        self.settled = true;
        self.session.attempt_busy(self.attempt);
    }

    /// The server answered with an error: the session works, and an unlock settles it.
    pub(super) fn failed(mut self) {
        self.settled = true;
        self.session
            .attempt_unconfirmed(self.attempt, self.timeout, true);
    }

    /// The attempt took `hold`: the session now holds it for a lease.
    pub(super) fn hold(mut self, hold: Advisory) -> Arc<Session> {
        self.settled = true;
        self.session.attempt_held(self.attempt, hold);
        self.session.clone()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.session
                .attempt_unconfirmed(self.attempt, self.timeout, false);
        }
    }
}
