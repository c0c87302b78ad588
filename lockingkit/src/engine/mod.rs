//! The engine: waiting, backoff, renewal, loss detection and release, written once for every
//! backend.

mod hold;
mod options;
mod waiting_room;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use options::LockOptions;

use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend, LockMode};
use crate::background::{self, BoxFuture, Orphanable};
use crate::error::{ErrorKind, LockError};
use crate::handle::LockHandle;
use crate::health::{Admission, Health, Probe, Refusal};
use crate::keys::validate_key;
use crate::telemetry::{KeyDigest, Operation, Outcome, Telemetry};

use crate::backoff::Backoff;
use hold::Hold;
use hold::RenewalScheduler;
use waiting_room::{Answer, Arrival, Occupied, Turn, WaitEvidence, WaitingRoom};

/// How long a connection-held lock goes unwatched after it is taken (see
/// `Engine::keeper_starts_after`). Loss through a closed connection is declared at most this
/// much later than the backend notices it, and still long before the next check.
const CONNECTION_WATCH_DELAY: Duration = Duration::from_millis(10);

/// How often a shutdown looks whether every lock and attempt has ended.
const SHUTDOWN_POLL: Duration = Duration::from_millis(5);

/// The shortest lease, check interval or renewal interval the engine accepts.
const SHORTEST_INTERVAL: Duration = Duration::from_millis(1);

/// What `DistributedLock` needs from an engine, without the backend type.
pub(crate) trait AnyEngine: Send + Sync {
    fn name(&self) -> &str;
    fn provider(&self) -> &str;
    fn try_acquire<'a>(
        self: Arc<Self>,
        key: &'a str,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<LockHandle, LockError>>;
    fn acquire<'a>(
        self: Arc<Self>,
        key: &'a str,
        mode: LockMode,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<LockHandle, LockError>>;
    /// Whether the backend can hold locks in `mode`.
    fn supports(&self, mode: LockMode) -> bool;
    /// The failure callers are refused with while the backend is failing.
    fn current_failure(&self) -> Option<LockError>;
    /// The backend's own startup check (see `LockBackend::verify`).
    fn verify(&self) -> BoxFuture<'_, Result<(), LockError>>;
    /// Refuses new acquires, gives up every lock, waits for the releases and clean-ups, then
    /// closes the backend; all within `timeout`.
    fn shutdown(self: Arc<Self>, timeout: Duration) -> BoxFuture<'static, Result<(), LockError>>;
    fn busy_keys(&self) -> usize;
    fn waiting(&self, key: &str) -> usize;
    fn backend_any(&self) -> &(dyn std::any::Any + Send + Sync);
}

pub(crate) struct Engine<B: LockBackend> {
    backend: Arc<B>,
    timing: LeaseTiming,
    options: LockOptions,
    room: Arc<WaitingRoom>,
    /// Local callers waiting for a semaphore that was full, one room per count with one queue
    /// per semaphore name in it (a namespace apart from lock keys): only the front one polls
    /// the backend. Semaphores of one name and different counts share no queue: a slot one
    /// cannot take, the other may.
    semaphore_rooms: Mutex<HashMap<u32, Arc<WaitingRoom>>>,
    scheduler: Arc<RenewalScheduler>,
    /// Whether the backend is failing: while it is, one attempt at a time goes out and the
    /// other callers are refused with the latest cause (see `crate::health`).
    health: Arc<Health>,
    /// Cancelled by [`shutdown`](AnyEngine::shutdown): new acquires are refused, waits end,
    /// and every keeper gives its lock up.
    pub(super) closed: CancellationToken,
    telemetry: Telemetry,
}

impl<B: LockBackend> Drop for Engine<B> {
    fn drop(&mut self) {
        // Every hold keeps the engine alive, so nothing is scheduled any more; this ends the
        // idle driver task.
        self.scheduler.close();
    }
}

/// The result of one backend attempt, with the turn it was made under.
type AttemptResult<L> = (Turn, Instant, Result<Option<Acquired<L>>, BackendError>);

impl<B: LockBackend> Engine<B> {
    pub(crate) fn new(
        name: &str,
        backend: B,
        options: LockOptions,
        meter: &opentelemetry::metrics::Meter,
        key_digest: Option<KeyDigest>,
    ) -> Result<Self, LockError> {
        options.validate(&format!("Locking.{name}"))?;
        let timing = backend.timing();
        let mut problems = Vec::new();
        match timing {
            // Below a millisecond the keeper would renew or check in a loop that never sleeps
            // (tokio's timers count in milliseconds), and no backend answers that fast anyway.
            LeaseTiming::Expiring(d) if d < SHORTEST_INTERVAL => problems.push(format!(
                "the backend's lease duration ({d:?}) must be at least {SHORTEST_INTERVAL:?}"
            )),
            LeaseTiming::ConnectionHeld(d) if d < SHORTEST_INTERVAL => problems.push(format!(
                "the backend's check interval ({d:?}) must be at least {SHORTEST_INTERVAL:?}"
            )),
            LeaseTiming::Expiring(d) => {
                if let Some(every) = options.renew_every.filter(|e| *e < SHORTEST_INTERVAL) {
                    problems.push(format!(
                        "Locking.{name}.renew_every ({every:?}) must be at least {SHORTEST_INTERVAL:?}"
                    ));
                }
                if let Some(every) = options.renew_every {
                    if every >= crate::clock::nine_tenths(d) {
                        problems.push(format!(
                            "Locking.{name}.renew_every ({every:?}) must be shorter than 90% of the lease ({d:?})"
                        ));
                    }
                }
            }
            LeaseTiming::ConnectionHeld(_) => {
                if options.renew_every.is_some() {
                    problems.push(format!(
                        "Locking.{name}.renew_every does not apply to this provider: its locks live as long as a connection, which it checks on its own interval"
                    ));
                }
            }
        }
        if !problems.is_empty() {
            return Err(LockError::misconfigured(problems));
        }
        Ok(Self::new_unchecked(
            name, backend, options, meter, key_digest,
        ))
    }

    /// Builds without validating; for option sets that are valid by construction.
    pub(crate) fn new_unchecked(
        name: &str,
        backend: B,
        options: LockOptions,
        meter: &opentelemetry::metrics::Meter,
        key_digest: Option<KeyDigest>,
    ) -> Self {
        let telemetry = Telemetry::new(name, backend.provider(), meter, key_digest);
        let health = Health::logged(
            options.min_retry_delay,
            options.max_outage_retry_delay,
            telemetry.lock_name_shared(),
            telemetry.provider_shared(),
        );
        Engine {
            timing: backend.timing(),
            backend: Arc::new(backend),
            room: Arc::new(WaitingRoom::new(options.max_retry_delay)),
            options,
            semaphore_rooms: Mutex::default(),
            scheduler: Arc::new(RenewalScheduler::default()),
            health: Arc::new(health),
            closed: CancellationToken::new(),
            telemetry,
        }
    }

    /// How long after the acquire was sent the lock's keeper task starts: when the first
    /// renewal is due for an expiring lease. A connection-held lock can end any time its
    /// connection does, and a backend may notice that without asking
    /// (`LockBackend::lease_ended`; expiring backends that watch their leases say so with
    /// `LockBackend::watches_leases`), so its keeper starts almost at once — yet not at once:
    /// a task per acquire costs cross-thread wake-ups that were a third of a PostgreSQL
    /// try_acquire+release pair, and most holds are shorter than this.
    fn keeper_starts_after(&self) -> Duration {
        match self.timing {
            LeaseTiming::Expiring(lease) => {
                let renewal = self.options.renew_every.unwrap_or(lease / 3);
                if self.backend.watches_leases() {
                    renewal.min(CONNECTION_WATCH_DELAY)
                } else {
                    renewal
                }
            }
            LeaseTiming::ConnectionHeld(interval) => interval.min(CONNECTION_WATCH_DELAY),
        }
    }

    /// Whether an attempt may go out now (see `crate::health`): `Err` with the latest cause
    /// while the backend is failing and another caller probes it, or the probe is not due.
    fn admit(&self) -> Result<Option<Probe>, Refusal> {
        match self.health.admit() {
            Admission::Go => Ok(None),
            Admission::Probe(probe) => Ok(Some(probe)),
            Admission::Refused(refusal) => Err(refusal),
        }
    }

    /// One backend attempt under `turn`, let through by [`admit`](Self::admit) (as its `probe`
    /// while the backend is failing); `again` when the turn attempted before, which callers that
    /// meet the key should know is in flight. If the caller drops this future while the attempt
    /// is in flight, the attempt finishes in the background, a lease it won is released, and
    /// only then does the turn pass to the next local waiter.
    fn attempt(
        &self,
        turn: Turn,
        mode: LockMode,
        probe: Option<Probe>,
        again: bool,
    ) -> Orphanable<AttemptResult<B::Lease>, ReleaseOrphanedWin<B>> {
        let backend = self.backend.clone();
        let health = self.health.clone();
        let release_timeout = self.options.release_timeout;
        let work = async move {
            let sent = Instant::now();
            if again {
                turn.note_sent(sent);
            }
            let result = match mode {
                LockMode::Exclusive => backend.try_acquire(turn.key()).await,
                mode => backend.try_acquire_in(turn.key(), mode).await,
            };
            let answer = match &result {
                Ok(Some(_)) => Answer::Took,
                Ok(None) => Answer::Busy,
                Err(error) => Answer::Failed(error.clone()),
            };
            match (&answer, probe) {
                (Answer::Failed(error), Some(probe)) => probe.failed(error),
                (Answer::Failed(error), None) => {
                    health.failed(error, false);
                }
                (_, Some(probe)) => {
                    probe.answered();
                }
                (_, None) => {
                    health.answered();
                }
            }
            turn.note_attempt(answer);
            (turn, sent, result)
        };
        Orphanable::new(
            work,
            ReleaseOrphanedWin {
                backend: self.backend.clone(),
                release_timeout,
            },
        )
    }

    fn hold(
        self: &Arc<Self>,
        caller: &Caller,
        turn: Turn,
        mode: LockMode,
        acquired: Acquired<B::Lease>,
        sent: Instant,
    ) -> LockHandle {
        let turn = match mode {
            LockMode::Semaphore { max_count } => self.semaphore_holder_turn(turn, max_count),
            _ => turn,
        };
        let held = Arc::new(Hold::new(
            self.clone(),
            caller.runtime.clone(),
            turn,
            acquired,
            sent,
            caller.span.clone(),
        ));
        self.telemetry.lock_taken();
        held.schedule();
        if self.closed.is_cancelled() {
            // Won as the engine shut down: the keeper gives it up at once.
            self.scheduler.start_all();
        }
        LockHandle::new(held)
    }

    /// The hold of a lock won under a queue's turn. A semaphore holder keeps a lane of its own:
    /// the queue's turn passes on now, so the next local waiter attempts at once.
    fn hold_won(
        self: &Arc<Self>,
        caller: &Caller,
        turn: Turn,
        mode: LockMode,
        acquired: Acquired<B::Lease>,
        sent: Instant,
    ) -> LockHandle {
        let turn = match mode {
            LockMode::Semaphore { .. } => {
                let lane = self.room.own_lane(turn.key());
                drop(turn);
                lane
            }
            _ => turn,
        };
        self.hold(caller, turn, mode, acquired, sent)
    }

    /// The room of the local queues for semaphores of `max_count`.
    fn semaphore_room(&self, max_count: u32) -> Arc<WaitingRoom> {
        let mut rooms = self
            .semaphore_rooms
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        rooms
            .entry(max_count)
            .or_insert_with(|| Arc::new(WaitingRoom::new(self.options.max_retry_delay)))
            .clone()
    }

    /// The turn a semaphore holder keeps, its lane, made to nudge the front local waiter of the
    /// semaphore when the hold ends.
    fn semaphore_holder_turn(&self, lane: Turn, max_count: u32) -> Turn {
        let key = lane.key().clone();
        lane.nudging(self.semaphore_room(max_count), key)
    }

    /// The turn a caller in `mode` gets at once, if any: exclusive callers take the key's turn
    /// (or are told why not); readers take a lane of their own, and so do semaphore callers
    /// unless callers here already wait for the semaphore (it was full: they go first).
    fn try_turn(self: &Arc<Self>, key: &str, mode: LockMode) -> Result<Turn, Occupied> {
        match mode {
            LockMode::Exclusive => self.room.try_enter(key),
            LockMode::Semaphore { max_count } => match self.semaphore_room(max_count).occupied(key)
            {
                Some(occupied) => Err(occupied),
                None => Ok(self.room.own_lane(key)),
            },
            LockMode::Shared => Ok(self.room.own_lane(key)),
        }
    }

    /// The turn for one attempt at `key`, or what the caller is told instead: a local caller
    /// that holds or attempts the key answers for it (single flight: a caller that meets an
    /// attempt still in flight waits for its answer rather than guess, or send another).
    async fn try_turn_or_refusal(
        self: &Arc<Self>,
        key: &str,
        mode: LockMode,
    ) -> Result<Turn, LockError> {
        loop {
            let evidence = match self.try_turn(key, mode) {
                Ok(turn) => return Ok(turn),
                Err(Occupied::Known(evidence)) => evidence,
                Err(Occupied::Pending(answer)) => match answer.evidence().await {
                    Some(evidence) => evidence,
                    // The turn passed on without an answer: look again.
                    None => continue,
                },
            };
            return Err(refusal_error(evidence));
        }
    }

    async fn try_acquire_inner(
        self: &Arc<Self>,
        key: &str,
        mode: LockMode,
        attempts: &mut u64,
        span: tracing::Span,
    ) -> Result<LockHandle, LockError> {
        validate_key(key)?;
        let caller = Caller::here(span)?;
        let turn = self.try_turn_or_refusal(key, mode).await?;
        let probe = match self.admit() {
            Ok(probe) => probe,
            Err(refusal) => {
                turn.note_attempt(Answer::Failed(refusal.cause.clone()));
                return Err(failing_error(refusal));
            }
        };
        *attempts += 1;
        match self.attempt(turn, mode, probe, false).await {
            (turn, sent, Ok(Some(acquired))) => Ok(self.hold(&caller, turn, mode, acquired, sent)),
            (_, _, Ok(None)) => Err(LockError::busy()),
            (_, _, Err(error)) => Err(attempt_error(error)),
        }
    }

    async fn acquire_inner(
        self: &Arc<Self>,
        key: &str,
        mode: LockMode,
        timeout: Duration,
        attempts: &mut u64,
        span: tracing::Span,
    ) -> Result<LockHandle, LockError> {
        validate_key(key)?;
        let caller = Caller::here(span)?;
        let deadline = crate::clock::in_(timeout);
        // What the latest finished attempt found, and when the one in flight (if any) was sent:
        // they decide between `Timeout` and `Unavailable` (see `wait_outcome`).
        let mut latest = Latest::NoAnswer;
        let mut in_flight: Option<Instant> = None;
        // A semaphore caller tries at once, on a lane of its own, unless callers here already
        // wait for the semaphore; only if it is full does it join them, so an uncontended
        // semaphore takes parallel callers in parallel and a full one costs one poller.
        let mut attempted = false;
        let nobody_waits = |max_count| self.semaphore_room(max_count).occupied(key).is_none();
        if matches!(mode, LockMode::Semaphore { max_count } if nobody_waits(max_count)) {
            match self.admit() {
                Ok(probe) => {
                    *attempts += 1;
                    in_flight = Some(Instant::now());
                    let first = self.attempt(self.room.own_lane(key), mode, probe, false);
                    let Ok((lane, sent, result)) = tokio::time::timeout_at(deadline, first).await
                    else {
                        return Err(wait_outcome(
                            timeout,
                            latest,
                            in_flight,
                            self.options.max_retry_delay,
                        ));
                    };
                    in_flight = None;
                    match result {
                        Ok(Some(acquired)) => {
                            return Ok(self.hold(&caller, lane, mode, acquired, sent))
                        }
                        Ok(None) => latest = Latest::Busy,
                        Err(error) => latest = Latest::after_failure(error)?,
                    }
                }
                Err(refusal) => latest = Latest::after_failure(refusal.cause)?,
            }
            attempted = true;
        }
        let (turn, queued) = self.wait_for_turn(key, mode, deadline, timeout).await?;
        let mut backoff = Backoff::new(self.options.min_retry_delay, self.options.max_retry_delay);
        // A semaphore's key names no lock, so the backend has nothing to watch for it; a local
        // holder that leaves nudges the front waiter instead.
        let nudge = match mode {
            LockMode::Semaphore { .. } => Some(turn.nudges()),
            _ => None,
        };
        // A turn that came through the queue is for attempting at once (the caller ahead took a
        // slot or left). A semaphore caller that is the front of the queue straight after its
        // first attempt waits before the next, and tells callers who queue behind it what that
        // attempt found.
        let mut skip_attempt = attempted && !queued;
        if skip_attempt {
            turn.note_attempt(latest.answer());
        }
        // Whether the turn has an answer on record, which callers that meet the key read until
        // the next attempt answers: they need to know when that attempt was sent.
        let mut noted = skip_attempt;
        let mut turn = Some(turn);
        let waited = tokio::time::timeout_at(deadline, async {
            loop {
                // Made before the attempt, so a release during the attempt is not missed.
                let hint = match &nudge {
                    Some(_) => None,
                    None => Some(self.backend.release_hint(key)),
                };
                let nudge = nudge.clone();
                let hint = async move {
                    match (hint, nudge) {
                        (Some(hint), _) => hint.await,
                        (None, Some(nudge)) => nudge.notified().await,
                        (None, None) => std::future::pending().await,
                    }
                };
                if !std::mem::take(&mut skip_attempt) {
                    let Some(current) = turn.take() else {
                        return Err(LockError::new(ErrorKind::Backend, "internal: turn lost"));
                    };
                    let current = match self.admit() {
                        Err(refusal) => {
                            // No request: the backend is failing and is not due to be asked.
                            latest = Latest::after_failure(refusal.cause)?;
                            current.note_attempt(latest.answer());
                            noted = true;
                            current
                        }
                        Ok(probe) => {
                            *attempts += 1;
                            in_flight = Some(Instant::now());
                            let again = std::mem::replace(&mut noted, true);
                            let (current, sent, result) =
                                self.attempt(current, mode, probe, again).await;
                            in_flight = None;
                            match result {
                                Ok(Some(acquired)) => {
                                    return Ok(self.hold_won(&caller, current, mode, acquired, sent))
                                }
                                Ok(None) => latest = Latest::Busy,
                                Err(error) => latest = Latest::after_failure(error)?,
                            }
                            current
                        }
                    };
                    turn = Some(current);
                }
                // Only a busy answer waits for the hint: after a failure the lock may well be
                // free, and a hint that fires whenever it is would turn backoff into a spin.
                let busy = matches!(latest, Latest::Busy);
                let wake = crate::clock::in_(backoff.next_delay());
                // The backend's hint, if it has one, cuts the sleep short. A sleep that would
                // end at or after the deadline is not armed: the deadline ends the wait, and the
                // turn stays with us so local waiters behind us stay quiet.
                tokio::select! {
                    biased;
                    _ = hint, if busy => {}
                    _ = tokio::time::sleep_until(wake), if wake < deadline => {}
                    // Neither: the deadline (outside) ends the wait.
                    else => std::future::pending::<()>().await,
                }
                if Instant::now() >= deadline {
                    // A hint that lands at the deadline starts no attempt: the time is up, and
                    // the deadline (outside) ends the wait.
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        match waited {
            Ok(result) => result,
            Err(_) => Err(wait_outcome(
                timeout,
                latest,
                in_flight,
                self.options.max_retry_delay,
            )),
        }
    }

    /// The turn to attempt `key` under, and whether the caller waited in a queue for it: at
    /// once for the front caller of an exclusive key or of a semaphore's queue, and for readers
    /// (a lane of their own); otherwise once the local callers ahead have gone, or a
    /// `Timeout`/`Unavailable` error at the deadline.
    async fn wait_for_turn(
        self: &Arc<Self>,
        key: &str,
        mode: LockMode,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(Turn, bool), LockError> {
        let arrival = match mode {
            LockMode::Exclusive => self.room.enter(key),
            LockMode::Semaphore { max_count } => self.semaphore_room(max_count).enter(key),
            LockMode::Shared => Arrival::Front(self.room.own_lane(key)),
        };
        let ticket = match arrival {
            Arrival::Front(turn) => return Ok((turn, false)),
            Arrival::Queued(ticket) => ticket,
        };
        self.telemetry.waiter_queued();
        let _left = Defer(|| self.telemetry.waiter_left());
        let evidence = ticket.evidence_handle();
        match tokio::time::timeout_at(deadline, ticket.turn()).await {
            // A turn that arrives at the deadline is passed on unused: the caller's time is up,
            // and an attempt now would only add a request.
            Ok(turn) if Instant::now() < deadline => Ok((turn, true)),
            _ => Err(wait_error(evidence.read(), timeout)),
        }
    }

    /// See [`AnyEngine::shutdown`]. Holds give their locks up through their keepers (started
    /// now for those still waiting for theirs), so a release answers as it does for a dropped
    /// handle; the engine is done once no key has an active party any more: every hold ended,
    /// every attempt (an orphaned one's clean-up included) finished.
    async fn shut_down(&self, timeout: Duration) -> Result<(), LockError> {
        let deadline = crate::clock::in_(timeout);
        self.closed.cancel();
        self.scheduler.start_all();
        // Nothing signals the last turn's end, and a shutdown is rare: look every few ms.
        while AnyEngine::busy_keys(self) > 0 {
            if Instant::now() >= deadline {
                return Err(LockError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "the shutdown did not finish within {timeout:?}: {} locks or attempts \
                         were still outstanding (their leases expire, or their connections \
                         close, at the backend)",
                        AnyEngine::busy_keys(self)
                    ),
                ));
            }
            tokio::time::sleep(SHUTDOWN_POLL).await;
        }
        if tokio::time::timeout_at(deadline, self.backend.shutdown())
            .await
            .is_err()
        {
            return Err(LockError::new(
                ErrorKind::Unavailable,
                format!("the backend did not close within the shutdown's {timeout:?}"),
            ));
        }
        Ok(())
    }

    /// Starts recording an acquire call: its span, and its outcome when it ends.
    fn record(&self, operation: Operation, mode: LockMode, key: &str) -> AcquireRecord<'_> {
        AcquireRecord {
            telemetry: &self.telemetry,
            span: self.telemetry.acquire_span(operation, mode, key),
            operation,
            mode,
            started: Instant::now(),
            attempts: 0,
            finished: false,
        }
    }

    // `try_acquire` and `acquire` are recorded by two functions rather than one that matches
    // on the operation: one future holding either inner future would be as large as the
    // waiting one, and `try_acquire` would box and copy those kilobytes on every call.

    async fn try_acquire_recorded(
        self: Arc<Self>,
        key: &str,
        mode: LockMode,
    ) -> Result<LockHandle, LockError> {
        let mut record = self.record(Operation::TryAcquire, mode, key);
        let span = record.span.clone();
        let result = match self.closed.is_cancelled() {
            true => Err(shut_down_error()),
            false => {
                let caller = caller_span(&span);
                background::traced(
                    span,
                    self.try_acquire_inner(key, mode, &mut record.attempts, caller),
                )
                .await
            }
        };
        record.finish(&result);
        result
    }

    async fn acquire_recorded(
        self: Arc<Self>,
        key: &str,
        mode: LockMode,
        timeout: Duration,
    ) -> Result<LockHandle, LockError> {
        let mut record = self.record(Operation::Acquire, mode, key);
        let span = record.span.clone();
        let caller = caller_span(&span);
        let waiting = background::traced(
            span,
            self.acquire_inner(key, mode, timeout, &mut record.attempts, caller),
        );
        // A shutdown ends every wait; an attempt in flight finishes in the background.
        let result = tokio::select! {
            biased;
            _ = self.closed.cancelled() => Err(shut_down_error()),
            result = waiting => result,
        };
        record.finish(&result);
        result
    }
}

impl<B: LockBackend> AnyEngine for Engine<B> {
    fn name(&self) -> &str {
        self.telemetry.lock_name()
    }

    fn provider(&self) -> &str {
        self.telemetry.provider()
    }

    fn try_acquire<'a>(
        self: Arc<Self>,
        key: &'a str,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<LockHandle, LockError>> {
        Box::pin(self.try_acquire_recorded(key, mode))
    }

    fn acquire<'a>(
        self: Arc<Self>,
        key: &'a str,
        mode: LockMode,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<LockHandle, LockError>> {
        Box::pin(self.acquire_recorded(key, mode, timeout))
    }

    fn supports(&self, mode: LockMode) -> bool {
        self.backend.supports(mode)
    }

    fn current_failure(&self) -> Option<LockError> {
        self.health.current_failure().map(failing_error)
    }

    fn verify(&self) -> BoxFuture<'_, Result<(), LockError>> {
        Box::pin(async move {
            self.backend
                .verify()
                .await
                .map_err(BackendError::into_lock_error)
        })
    }

    fn shutdown(self: Arc<Self>, timeout: Duration) -> BoxFuture<'static, Result<(), LockError>> {
        Box::pin(async move { self.shut_down(timeout).await })
    }

    fn busy_keys(&self) -> usize {
        let rooms = self
            .semaphore_rooms
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.room.active_keys() + rooms.values().map(|room| room.active_keys()).sum::<usize>()
    }

    fn waiting(&self, key: &str) -> usize {
        self.room.waiting(key)
    }

    fn backend_any(&self) -> &(dyn std::any::Any + Send + Sync) {
        &*self.backend
    }
}

/// Releases whatever an attempt won after its caller went away, then passes the turn on.
pub(crate) struct ReleaseOrphanedWin<B> {
    backend: Arc<B>,
    release_timeout: Duration,
}

impl<B: LockBackend> background::Cleanup<AttemptResult<B::Lease>> for ReleaseOrphanedWin<B> {
    fn clean_up(self, (turn, _, result): AttemptResult<B::Lease>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            if let Ok(Some(acquired)) = result {
                let _ =
                    background::within(self.release_timeout, self.backend.release(&acquired.lease))
                        .await;
            }
            drop(turn);
        })
    }
}

/// Records the outcome of an acquire call; a call dropped before it finished is `cancelled`.
struct AcquireRecord<'a> {
    telemetry: &'a Telemetry,
    span: tracing::Span,
    operation: Operation,
    mode: LockMode,
    started: Instant,
    attempts: u64,
    finished: bool,
}

impl AcquireRecord<'_> {
    fn finish(&mut self, result: &Result<LockHandle, LockError>) {
        self.finished = true;
        let (outcome, error, token) = match result {
            Ok(handle) => (Outcome::Acquired, None, Some(handle.fencing_token())),
            Err(error) => (Outcome::of(&Err(error)), Some(error), None),
        };
        self.emit(outcome, error, token);
    }

    fn emit(&self, outcome: Outcome, error: Option<&LockError>, token: Option<u64>) {
        self.telemetry.acquire_finished(
            &self.span,
            self.operation,
            self.mode,
            outcome,
            error,
            self.attempts,
            self.started.elapsed(),
            token,
        );
    }
}

impl Drop for AcquireRecord<'_> {
    fn drop(&mut self) {
        if !self.finished {
            self.emit(Outcome::Cancelled, None, None);
        }
    }
}

/// Runs a closure when dropped.
struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Where an acquire call comes from: the runtime its hold will live on, and the caller's span
/// (a request's, say), which a loss of the hold is logged under.
struct Caller {
    runtime: tokio::runtime::Handle,
    span: tracing::Span,
}

impl Caller {
    fn here(span: tracing::Span) -> Result<Caller, LockError> {
        Ok(Caller {
            runtime: current_runtime()?,
            span,
        })
    }
}

/// The caller's current span, when anyone traces this acquire (its own span is enabled);
/// otherwise none, which costs nothing.
fn caller_span(acquire_span: &tracing::Span) -> tracing::Span {
    if acquire_span.is_disabled() {
        tracing::Span::none()
    } else {
        tracing::Span::current()
    }
}

fn current_runtime() -> Result<tokio::runtime::Handle, LockError> {
    tokio::runtime::Handle::try_current().map_err(|_| {
        LockError::new(
            ErrorKind::Misconfigured,
            "LockingKit must run inside a tokio runtime (it renews held locks in the background)",
        )
    })
}

fn attempt_error(error: BackendError) -> LockError {
    match error.kind() {
        // "Lease gone" has no meaning before a lease exists; treat it as the transient
        // failure it is.
        crate::backend::BackendErrorKind::LeaseGone => {
            LockError::new(ErrorKind::Unavailable, error.message().to_owned()).with_source(error)
        }
        _ => error.into_lock_error(),
    }
}

/// What a `try_acquire` that could not enter is told: busy only on evidence that someone holds
/// the key; the failure of the latest attempt as that failure.
fn refusal_error(evidence: WaitEvidence) -> LockError {
    match evidence {
        WaitEvidence::Contended => LockError::busy(),
        WaitEvidence::Failing(cause) => attempt_error(cause),
        WaitEvidence::Unanswered => LockError::new(
            ErrorKind::Unavailable,
            "the backend did not answer the attempt in flight for this key",
        ),
    }
}

/// What a caller is told when its attempt is not sent because the backend is failing.
fn failing_error(refusal: Refusal) -> LockError {
    let now = Instant::now();
    let failing_for = now.saturating_duration_since(refusal.since);
    let asked_in = refusal.retry_at.saturating_duration_since(now);
    let error = attempt_error(refusal.cause);
    let message = format!(
        "{} (not sent: the backend has been failing for {failing_for:?}, and is asked again in \
         {asked_in:?})",
        error.message()
    );
    error.with_message(message)
}

/// How a queued waiter's wait ends at its deadline, from what it knows about the key.
fn wait_error(evidence: WaitEvidence, timeout: Duration) -> LockError {
    match evidence {
        WaitEvidence::Contended => timeout_error(timeout),
        WaitEvidence::Failing(cause) if cause.is_transient() => {
            let what = if cause.reached() {
                "the backend answered the latest attempt for this key with a failure"
            } else {
                "the latest attempt for this key could not reach the backend"
            };
            let message = format!(
                "{what} ({}), and the timeout of {timeout:?} ran out",
                cause.message()
            );
            LockError::new(ErrorKind::Unavailable, message).with_source(cause)
        }
        WaitEvidence::Failing(cause) => attempt_error(cause),
        WaitEvidence::Unanswered => LockError::new(
            ErrorKind::Unavailable,
            format!("no attempt for this key was answered within the timeout of {timeout:?}"),
        ),
    }
}

/// What a caller of an engine that was shut down is told.
fn shut_down_error() -> LockError {
    LockError::new(ErrorKind::Unavailable, "the lock provider was shut down")
}

fn timeout_error(timeout: Duration) -> LockError {
    LockError::new(
        ErrorKind::Timeout,
        format!("the lock stayed busy for the whole timeout of {timeout:?}"),
    )
}

fn unreachable_error(timeout: Duration) -> LockError {
    LockError::new(
        ErrorKind::Unavailable,
        format!("no attempt reached the backend within the timeout of {timeout:?}"),
    )
}

/// What the latest finished attempt of a wait found.
enum Latest {
    /// No attempt has finished yet.
    NoAnswer,
    /// The backend answered "busy".
    Busy,
    /// The attempt failed: the backend reported a failure itself (a 5xx, a full lock table), or
    /// could not be reached ([`BackendError::reached`] tells which), or the attempt was not
    /// sent because the backend was failing already.
    Failed(BackendError),
}

impl Latest {
    /// The answer this stands for, for callers that meet the key.
    fn answer(&self) -> Answer {
        match self {
            // Only noted after an attempt finished; "busy" is the answer that claims least.
            Latest::NoAnswer | Latest::Busy => Answer::Busy,
            Latest::Failed(cause) => Answer::Failed(cause.clone()),
        }
    }

    /// What a failed attempt found; a failure no retry can fix ends the wait with its error.
    fn after_failure(error: BackendError) -> Result<Latest, LockError> {
        if error.is_transient() {
            Ok(Latest::Failed(error))
        } else {
            Err(attempt_error(error))
        }
    }
}

/// How a wait that ran out of time ends: `Timeout` only if the backend was answering "busy" at
/// the end; `Unavailable` (with the latest cause) if the latest attempt failed, whether the
/// backend reported the failure or could not be reached.
///
/// The latest *finished* attempt decides, except that an attempt still unanswered at the
/// deadline after `patience` (the longest the engine sleeps between attempts: a backend that
/// answers takes far less) counts as not reaching the backend, so an outage that hangs
/// requests after a busy answer is not reported as contention either.
fn wait_outcome(
    timeout: Duration,
    latest: Latest,
    in_flight: Option<Instant>,
    patience: Duration,
) -> LockError {
    if let Some(sent) = in_flight {
        let unanswered = sent.elapsed();
        if unanswered >= patience {
            return LockError::new(
                ErrorKind::Unavailable,
                format!(
                    "the backend did not answer the latest attempt within {unanswered:?}, and the timeout of {timeout:?} ran out"
                ),
            );
        }
    }
    match latest {
        Latest::Busy => timeout_error(timeout),
        Latest::Failed(cause) if cause.reached() => LockError::new(
            ErrorKind::Unavailable,
            format!(
                "the backend answered the latest attempt with a failure ({}), and the timeout of {timeout:?} ran out",
                cause.message()
            ),
        )
        .with_source(cause),
        Latest::NoAnswer => unreachable_error(timeout),
        Latest::Failed(cause) => LockError::new(
            ErrorKind::Unavailable,
            format!(
                "the latest attempt could not reach the backend ({}), and the timeout of {timeout:?} ran out",
                cause.message()
            ),
        )
        .with_source(cause),
    }
}
