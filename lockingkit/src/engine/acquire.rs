//! The acquire path, the same for every lock mode: enter the key's lane in the waiting room,
//! attempt under the turn (let through by the outage gate), and on a busy answer wait where
//! the lane says — at the front of its queue, backing off until the backend's release hint or
//! a local release nudges, or behind the others. What differs between modes is the lane's
//! (see `waiting_room`), not this loop's.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::hold::Hold;
use super::outcome::{
    attempt_error, failing_error, refusal_error, shut_down_error, wait_error, wait_outcome, Latest,
};
use super::waiting_room::{Answer, Arrival, Lane, Occupied, Ticket, Turn, Waiting};
use super::Engine;
use crate::backend::{Acquired, BackendError, LockBackend, LockMode};
use crate::background::{self, BoxFuture, Orphanable};
use crate::backoff::Backoff;
use crate::error::{ErrorKind, LockError};
use crate::handle::LockHandle;
use crate::health::{Admission, Probe, Refusal};
use crate::keys::validate_key;
use crate::telemetry::{Operation, Outcome, Telemetry};

/// The result of one backend attempt, with the turn it was made under.
type AttemptResult<L> = (Turn, Instant, Result<Option<Acquired<L>>, BackendError>);

/// What a wait knows when its time runs out: the latest finished attempt's answer, and when
/// the one in flight (if any) was sent. They decide between `Timeout` and `Unavailable` (see
/// `outcome::wait_outcome`).
struct Wait {
    latest: Latest,
    in_flight: Option<Instant>,
    deadline: Instant,
    timeout: Duration,
}

/// An attempt that did not take the lock: the turn it was made under.
enum Attempted<L> {
    Took(Turn, Acquired<L>, Instant),
    Not(Turn),
}

impl<B: LockBackend> Engine<B> {
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
    /// while the backend is failing); `again` when the turn's queue has an answer on record,
    /// which callers that meet the queue should know is being renewed. If the caller drops
    /// this future while the attempt is in flight, the attempt finishes in the background, a
    /// lease it won is released, and only then does the turn pass to the next local waiter.
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
            let result = backend.try_acquire(turn.key(), mode).await;
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

    /// The handle of a lock won under `turn`: the turn becomes what its lane's holder keeps.
    fn hold(
        self: &Arc<Self>,
        caller: &Caller,
        turn: Turn,
        acquired: Acquired<B::Lease>,
        sent: Instant,
    ) -> LockHandle {
        let held = Arc::new(Hold::new(
            self.clone(),
            caller.runtime.clone(),
            turn.into_holder(),
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

    /// The turn for one attempt at `key`, or what the caller is told instead: a local caller
    /// that holds or attempts the key answers for it (single flight: a caller that meets an
    /// attempt still in flight waits for its answer rather than guess, or send another).
    async fn try_turn_or_refusal(
        self: &Arc<Self>,
        key: &str,
        lane: Lane,
    ) -> Result<Turn, LockError> {
        loop {
            let evidence = match self.room.try_enter(key, lane) {
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
        let turn = self.try_turn_or_refusal(key, Lane::of(mode)).await?;
        let probe = match self.admit() {
            Ok(probe) => probe,
            Err(refusal) => {
                turn.note_attempt(Answer::Failed(refusal.cause.clone()));
                return Err(failing_error(refusal));
            }
        };
        *attempts += 1;
        match self.attempt(turn, mode, probe, false).await {
            (turn, sent, Ok(Some(acquired))) => Ok(self.hold(&caller, turn, acquired, sent)),
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
        let mut wait = Wait {
            latest: Latest::NoAnswer,
            in_flight: None,
            deadline: crate::clock::in_(timeout),
            timeout,
        };
        // A fresh queue's first attempt has no answer on record to renew; any later one has.
        let (turn, fresh) = match self.room.enter(key, Lane::of(mode)) {
            Arrival::Attempt(turn) => (turn, true),
            Arrival::Queued(ticket) => (self.queued(ticket, &wait).await?, false),
        };
        let deadline = wait.deadline;
        let trying = self.keep_trying(turn, fresh, key, mode, &mut wait, attempts, &caller);
        match tokio::time::timeout_at(deadline, trying).await {
            Ok(result) => result,
            Err(_) => Err(wait_outcome(
                timeout,
                wait.latest,
                wait.in_flight,
                self.options.max_retry_delay,
            )),
        }
    }

    /// Attempts under `turn` until the lock is taken or no retry can help; the caller's
    /// deadline (outside) ends it otherwise.
    #[allow(clippy::too_many_arguments)]
    async fn keep_trying(
        self: &Arc<Self>,
        mut turn: Turn,
        mut fresh: bool,
        key: &str,
        mode: LockMode,
        wait: &mut Wait,
        attempts: &mut u64,
        caller: &Caller,
    ) -> Result<LockHandle, LockError> {
        let mut backoff = Backoff::new(self.options.min_retry_delay, self.options.max_retry_delay);
        loop {
            // Made before the attempt, so a release during the attempt is not missed.
            let hint = self.backend.release_hint(key, mode);
            let again = !std::mem::replace(&mut fresh, false);
            let not_taken = match self.attempt_once(turn, mode, again, wait, attempts).await? {
                Attempted::Took(won, acquired, sent) => {
                    return Ok(self.hold(caller, won, acquired, sent))
                }
                Attempted::Not(not_taken) => not_taken,
            };
            turn = match not_taken.wait_here() {
                Waiting::Front(front) => front,
                // Callers ahead wait for the same thing: when the turn reaches this one, it
                // attempts at once.
                Waiting::Queued(ticket) => {
                    turn = self.queued(ticket, wait).await?;
                    continue;
                }
            };
            // Callers that meet the queue read what the front found.
            turn.note_attempt(wait.latest.answer());
            self.back_off(&mut backoff, hint, turn.nudges(), wait).await;
        }
    }

    /// One attempt, unless the backend is failing and not due to be asked, which is an answer
    /// too; a failure no retry can fix ends the wait with its error.
    async fn attempt_once(
        &self,
        turn: Turn,
        mode: LockMode,
        again: bool,
        wait: &mut Wait,
        attempts: &mut u64,
    ) -> Result<Attempted<B::Lease>, LockError> {
        let probe = match self.admit() {
            Ok(probe) => probe,
            Err(refusal) => {
                wait.latest = Latest::after_failure(refusal.cause)?;
                return Ok(Attempted::Not(turn));
            }
        };
        *attempts += 1;
        wait.in_flight = Some(Instant::now());
        let (turn, sent, result) = self.attempt(turn, mode, probe, again).await;
        wait.in_flight = None;
        match result {
            Ok(Some(acquired)) => return Ok(Attempted::Took(turn, acquired, sent)),
            Ok(None) => wait.latest = Latest::Busy,
            Err(error) => wait.latest = Latest::after_failure(error)?,
        }
        Ok(Attempted::Not(turn))
    }

    /// Sleeps out the next backoff step, cut short after a busy answer by the backend's hint
    /// or a local release that freed what the turn waits for. A sleep that would end at or
    /// after the deadline is not armed: the deadline (outside) ends the wait, and the turn
    /// stays with us so local waiters behind us stay quiet.
    async fn back_off(
        &self,
        backoff: &mut Backoff,
        hint: impl std::future::Future<Output = ()>,
        nudge: Option<Arc<tokio::sync::Notify>>,
        wait: &Wait,
    ) {
        // Only a busy answer waits for a wake-up: after a failure the lock may well be free,
        // and a wake-up that fires whenever it is would turn backoff into a spin.
        let busy = matches!(wait.latest, Latest::Busy);
        let nudged = async {
            match nudge {
                Some(nudge) => nudge.notified().await,
                None => std::future::pending().await,
            }
        };
        let wake = crate::clock::in_(backoff.next_delay());
        tokio::select! {
            biased;
            _ = hint, if busy => {}
            _ = nudged, if busy => {}
            _ = tokio::time::sleep_until(wake), if wake < wait.deadline => {}
            // Neither: the deadline (outside) ends the wait.
            else => std::future::pending::<()>().await,
        }
        if Instant::now() >= wait.deadline {
            // A wake-up that lands at the deadline starts no attempt: the time is up.
            std::future::pending::<()>().await;
        }
    }

    /// Waits in the queue for the turn, or until the deadline, which ends the wait with what
    /// is known about the key.
    async fn queued(&self, ticket: Ticket, wait: &Wait) -> Result<Turn, LockError> {
        self.telemetry.waiter_queued();
        let _left = Defer(|| self.telemetry.waiter_left());
        let evidence = ticket.evidence_handle();
        match tokio::time::timeout_at(wait.deadline, ticket.turn()).await {
            // A turn that arrives at the deadline is passed on unused: the caller's time is up,
            // and an attempt now would only add a request.
            Ok(turn) if Instant::now() < wait.deadline => Ok(turn),
            _ => Err(wait_error(evidence.read(), wait.timeout)),
        }
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

    pub(super) async fn try_acquire_recorded(
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

    pub(super) async fn acquire_recorded(
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
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::new(
                ErrorKind::Misconfigured,
                "LockingKit must run inside a tokio runtime (it renews held locks in the background)",
            )
        })?;
        Ok(Caller { runtime, span })
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
