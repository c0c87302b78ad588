//! The bounded set of sessions a backend's locks share.
//!
//! This is not a pool: no session is ever handed to one caller. Every attempt, unlock and
//! check of every lock is sent on one of at most `max` open sessions, pipelined with the others,
//! so the connections a process uses do not grow with the locks it holds. Sessions open on
//! demand, one at a time: a new one only when every open one has [`PIPELINE_DEPTH`] statements
//! in flight, up to `max`. A session that ends leaves the set at once, and the next attempt
//! that needs one opens a replacement.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_postgres::Config;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::session::{Availability, Session};
use crate::backend::BackendError;

/// Statements in flight on every open session before another one opens. Statements that
/// queue on one session reach the server in fewer packets and cost it less per lock; past
/// this depth a further session spreads the work over another server process. 32 kept the
/// HTTP row of the benchmark on one session with the best requests/s, while 256 busy tasks
/// still spread over four (the fleet rows of docs/performance.md compare depths 1 to 64).
const PIPELINE_DEPTH: usize = 32;

pub(super) struct SessionSet {
    slots: Mutex<Slots>,
    /// Woken when a session opens, fails to open, or stops draining.
    changed: Arc<Notify>,
    max: usize,
    config: Config,
    tls: MakeRustlsConnect,
    timeout: Duration,
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
    Wait,
}

impl SessionSet {
    pub(super) fn new(
        max: usize,
        config: Config,
        tls: MakeRustlsConnect,
        timeout: Duration,
    ) -> Self {
        SessionSet {
            slots: Mutex::new(Slots::default()),
            changed: Arc::new(Notify::new()),
            max,
            config,
            tls,
            timeout,
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

    /// Reserves `key` on a session that neither holds it nor may hold it: the least loaded
    /// open one, or a new one while every open one is busy and the set has room. `None`: this
    /// process holds the key (or may still hold it) on every session it could use.
    pub(super) async fn reserve(&self, key: i64) -> Result<Option<Reservation>, BackendError> {
        let give_up = crate::clock::in_(self.timeout);
        loop {
            let changed = self.changed.notified();
            match self.look(key) {
                Step::Use(reservation) => return Ok(Some(reservation)),
                Step::HeldHere => return Ok(None),
                Step::Connect => return self.connect(key).await.map(Some),
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

    fn look(&self, key: i64) -> Step {
        let mut slots = self.slots();
        slots.open.retain(|s| !s.is_closed());
        // One session opens at a time, and only when every open one is busy: a burst of
        // attempts at startup waits for the first session instead of opening them all, and
        // statements batch on few sessions, which costs the server less per lock.
        let room = slots.connecting == 0 && slots.open.len() < self.max;
        let mut best: Option<&Arc<Session>> = None;
        let mut holds_key = false;
        for session in &slots.open {
            match session.availability(key) {
                Availability::Draining => continue,
                Availability::HasKey => {
                    holds_key = true;
                    continue;
                }
                Availability::Free => {}
            }
            if best.is_none_or(|b| session.load() < b.load()) {
                best = Some(session);
            }
        }
        match best {
            Some(session) if session.load() < PIPELINE_DEPTH || !room => {
                let session = session.clone();
                if session.reserve(key) {
                    Step::Use(Reservation::new(session, key, self.timeout))
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
            // A session is opening, or every one is draining.
            _ => Step::Wait,
        }
    }

    async fn connect(&self, key: i64) -> Result<Reservation, BackendError> {
        /// Gives the slot back if the connect fails or its caller goes away.
        struct Connecting<'a>(&'a SessionSet);
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
        let session = Box::pin(Session::open(
            &self.config,
            &self.tls,
            self.timeout,
            self.changed.clone(),
        ))
        .await?;
        let session = Arc::new(session);
        // A new session holds nothing, so the key is free on it.
        session.reserve(key);
        self.slots().open.push(session.clone());
        drop(connecting);
        Ok(Reservation::new(session, key, self.timeout))
    }

    /// Closes every session; their locks are lost.
    pub(super) fn close_all(&self) {
        for session in self.slots().open.drain(..) {
            session.close();
        }
    }
}

/// A key reserved on a session for one attempt. Dropped before the attempt's answer was read,
/// the key is treated as possibly held (see [`Session::mark_unconfirmed`]).
pub(super) struct Reservation {
    session: Arc<Session>,
    key: i64,
    timeout: Duration,
    settled: bool,
}

impl Reservation {
    fn new(session: Arc<Session>, key: i64, timeout: Duration) -> Self {
        Reservation {
            session,
            key,
            timeout,
            settled: false,
        }
    }

    pub(super) fn session(&self) -> &Session {
        &self.session
    }

    /// The server says the session does not hold the key.
    pub(super) fn free(mut self) {
        self.settled = true;
        self.session.mark_free(self.key);
    }

    /// The server answered with an error: the session works, and an unlock settles the key.
    pub(super) fn failed(mut self) {
        self.settled = true;
        self.session.mark_unconfirmed(self.key, self.timeout, true);
    }

    /// The attempt took the key: the session now holds it for a lease.
    pub(super) fn hold(mut self) -> Arc<Session> {
        self.settled = true;
        self.session.mark_held(self.key);
        self.session.clone()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.session.mark_unconfirmed(self.key, self.timeout, false);
        }
    }
}
