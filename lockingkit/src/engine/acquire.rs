//! The acquire path, the same for every lock mode: enter the key's lane in the waiting room,
//! attempt under the turn (let through by the outage gate), and on a busy answer wait where
//! the lane says — at the front of its queue, with the backend's [`Wait`] open, backing off
//! until the wait, a local release or the backoff says to attempt again, or behind the others.
//! What differs between modes is the lane's (see `waiting_room`), not this loop's.
//!
//! # What a caller is told
//! - Every wait gets an answer before it ends: its own attempt's, or the answer of the attempt
//!   in flight for its key. A deadline does not cut an attempt short: an attempt in flight at
//!   the deadline is awaited (for at most the engine's patience), so a zero or short wait on a
//!   backend that answers "busy" ends `Busy`/`Timeout`, never `Unavailable`.
//! - A failure ends a wait at once with its cause: the outage gate says the backend is failing
//!   from that moment, and while it does, waiting callers are refused, not left to hang until
//!   their timeouts. Waiters that are sleeping or queued when another caller's attempt fails
//!   end too ([`Health::failing`]).
//! - An attempt unanswered for the engine's patience (`max_retry_delay`, and at least 2 s: a
//!   backend that answers takes far less) is an outage: its caller is told `Unavailable`, the
//!   gate starts failing, and the attempt finishes in the background.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::abandoned::Gone;
use super::hold::Hold;
use super::outcome::{
    attempt_error, failing_error, refusal_error, shut_down_error, unanswered, wait_error,
};
use super::waiting_room::{Answer, Arrival, Lane, Occupied, Ticket, Turn, Waiting};
use super::Engine;
use crate::backend::{Acquired, BackendError, LockBackend, LockMode, Wait, Woken};
use crate::background::{self, BoxFuture, Orphanable};
use crate::backoff::Backoff;
use crate::error::{ErrorKind, LockError};
use crate::handle::LockHandle;
use crate::health::{Admission, Probe, Refusal};
use crate::keys::validate_key;
use crate::telemetry::{Operation, Outcome, Telemetry};

/// The result of one backend attempt, with the turn it was made under.
type AttemptResult<L> = (Turn, Instant, Result<Option<Acquired<L>>, BackendError>);

/// When a wait's time is up, and how long it was.
struct Window {
    deadline: Instant,
    timeout: Duration,
}

impl Window {
    fn is_over(&self) -> bool {
        Instant::now() >= self.deadline
    }
}

/// What one attempt got, when it did not end the wait.
enum Attempted<L> {
    Took(Turn, Acquired<L>, Instant),
    Busy(Turn),
}

/// What ends a wait between two attempts.
enum Next<L> {
    Attempt,
    Granted(Acquired<L>, Instant),
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

    /// A plain attempt at `key` in `mode`, owning what it needs.
    fn request(
        &self,
        key: &Arc<str>,
        mode: LockMode,
    ) -> impl Future<Output = Result<Option<Acquired<B::Lease>>, BackendError>> + Send + 'static
    {
        let (backend, key) = (self.backend.clone(), key.clone());
        async move { backend.try_acquire(&key, mode).await }
    }

    /// One backend attempt, `request`, under `turn`, let through by [`admit`](Self::admit) (as
    /// its `probe` while the backend is failing); `again` when the turn's queue has an answer
    /// on record, which callers that meet the queue should know is being renewed. If the
    /// caller drops this future while the attempt is in flight, the attempt finishes in the
    /// background, a lease it won is released, and only then does the turn pass to the next
    /// local waiter.
    fn attempt(
        &self,
        turn: Turn,
        request: impl Future<Output = Result<Option<Acquired<B::Lease>>, BackendError>> + Send + 'static,
        probe: Option<Probe>,
        again: bool,
        gone: Arc<Gone>,
    ) -> Orphanable<AttemptResult<B::Lease>, ReleaseOrphanedWin<B>> {
        let health = self.health.clone();
        let cleanup = ReleaseOrphanedWin {
            backend: self.backend.clone(),
            release_timeout: self.options.release_timeout,
            gone: gone.clone(),
        };
        let work = async move {
            let sent = Instant::now();
            if again {
                turn.note_sent(sent);
            }
            let result = request.await;
            let answer = match &result {
                Ok(Some(_)) => Answer::Took,
                Ok(None) => Answer::Busy,
                Err(error) => Answer::Failed(error.clone()),
            };
            match (&answer, probe) {
                // Paced by the provider's own gate (a connect through its backoff): that gate
                // sets the pace, so the next caller may probe at once, and the cause stays
                // current.
                (Answer::Failed(error), Some(probe)) if error.is_paced_by_provider() => {
                    drop(probe);
                    health.failed(error, false);
                }
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
            if gone.left() {
                turn.note_abandoned_attempt(&answer);
            } else {
                turn.note_attempt(answer);
            }
            (turn, sent, result)
        };
        Orphanable::new(work, cleanup)
    }

    /// Sends one attempt under `turn` unless the outage gate refuses it, and awaits its answer
    /// for at most the engine's patience, whatever the caller's deadline: the answer is what
    /// the caller is told. Only a busy answer comes back as `Ok` without the lock; a failure, a
    /// refusal and an attempt left unanswered end the wait with their cause.
    async fn attempt_once(
        &self,
        turn: Turn,
        request: impl Future<Output = Result<Option<Acquired<B::Lease>>, BackendError>> + Send + 'static,
        again: bool,
        attempts: &mut u64,
    ) -> Result<Attempted<B::Lease>, LockError> {
        // An attempt on this key whose caller went away may still win it for nobody (in
        // another lane: this lane's waits for its turn): what it does is what this one finds.
        let settle_by = crate::clock::in_(self.room.patience());
        self.room.abandoned_settled(turn.key(), settle_by).await;
        let probe = match self.admit() {
            Ok(probe) => probe,
            Err(refusal) => {
                turn.note_attempt(Answer::Failed(refusal.cause.clone()));
                return Err(failing_error(refusal));
            }
        };
        *attempts += 1;
        let give_up = crate::clock::in_(self.room.patience());
        let gone = Arc::new(Gone::default());
        // Dropped with this future, or kept when the attempt goes unanswered: see
        // `CallerLeaving`.
        let leaving = turn.leaving(gone.clone());
        let attempt = self.attempt(turn, request, probe, again, gone);
        let answered = tokio::time::timeout_at(give_up, attempt).await;
        if answered.is_ok() {
            leaving.stayed();
        }
        match answered {
            Ok((turn, sent, Ok(Some(acquired)))) => Ok(Attempted::Took(turn, acquired, sent)),
            Ok((turn, _, Ok(None))) => Ok(Attempted::Busy(turn)),
            Ok((_, _, Err(error))) => Err(attempt_error(error)),
            Err(_) => {
                // The attempt goes on in the background; an answer, when it comes, ends the
                // outage this starts.
                let (cause, error) = unanswered(self.room.patience());
                self.health.failed(&cause, false);
                Err(error)
            }
        }
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
            caller.mode,
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
    /// attempt still in flight waits for its answer rather than guess, or send another). While
    /// the backend is failing, a caller that meets an attempt in flight (the probe) is refused
    /// at once with the cause rather than held for the probe's answer.
    async fn try_turn_or_refusal(
        self: &Arc<Self>,
        key: &str,
        lane: Lane,
    ) -> Result<Turn, LockError> {
        loop {
            let evidence = match self.room.try_enter(key, lane) {
                Ok(turn) => return Ok(turn),
                Err(Occupied::Known(evidence)) => evidence,
                Err(Occupied::Pending(answer)) => {
                    let answered = tokio::select! {
                        biased;
                        evidence = answer.evidence() => evidence,
                        refusal = self.health.failing() => return Err(failing_error(refusal)),
                    };
                    match answered {
                        Some(evidence) => evidence,
                        // The turn passed on without an answer: look again.
                        None => continue,
                    }
                }
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
        let caller = Caller::here(mode, span)?;
        let turn = self.try_turn_or_refusal(key, Lane::of(mode)).await?;
        let request = self.request(turn.key(), mode);
        match self.attempt_once(turn, request, false, attempts).await? {
            Attempted::Took(turn, acquired, sent) => Ok(self.hold(&caller, turn, acquired, sent)),
            Attempted::Busy(_) => Err(LockError::busy()),
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
        let caller = Caller::here(mode, span)?;
        let window = Window {
            deadline: crate::clock::in_(timeout),
            timeout,
        };
        // A fresh queue's first attempt has no answer on record to renew; any later one has.
        let (turn, fresh) = match self.room.enter(key, Lane::of(mode)) {
            Arrival::Attempt(turn) => (turn, true),
            Arrival::Queued(ticket) => (self.queued(ticket, &window).await?, false),
        };
        self.keep_trying(turn, fresh, mode, &window, attempts, &caller)
            .await
    }

    /// Attempts under `turn` until the lock is taken, the window is over after a busy answer,
    /// or an attempt fails. From the first busy answer at the front of its queue, the caller
    /// keeps the backend's [`Wait`] open and attempts through it; leaving (for any reason)
    /// drops it, which ends the wait at the backend.
    async fn keep_trying(
        self: &Arc<Self>,
        mut turn: Turn,
        mut fresh: bool,
        mode: LockMode,
        window: &Window,
        attempts: &mut u64,
        caller: &Caller,
    ) -> Result<LockHandle, LockError> {
        let mut backoff = Backoff::new(self.options.min_retry_delay, self.options.max_retry_delay);
        let mut waiting = None;
        loop {
            let again = !std::mem::replace(&mut fresh, false);
            let attempted = match waiting.as_mut() {
                Some(wait) => {
                    let request = Wait::try_acquire(wait);
                    self.attempt_once(turn, request, again, attempts).await?
                }
                None => {
                    let request = self.request(turn.key(), mode);
                    self.attempt_once(turn, request, again, attempts).await?
                }
            };
            let not_taken = match attempted {
                Attempted::Took(won, acquired, sent) => {
                    return Ok(self.hold(caller, won, acquired, sent))
                }
                Attempted::Busy(not_taken) if window.is_over() => {
                    drop(not_taken);
                    return Err(LockError::timed_out(window.timeout));
                }
                Attempted::Busy(not_taken) => not_taken,
            };
            turn = match not_taken.wait_here() {
                Waiting::Front(front) => front,
                // Callers ahead wait for the same thing: when the turn reaches this one, it
                // attempts at once. Its wait at the backend ends; the front's stands for it.
                Waiting::Queued(ticket) => {
                    waiting = None;
                    turn = self.queued(ticket, window).await?;
                    continue;
                }
            };
            // Callers that meet the queue read what the front found.
            turn.note_attempt(Answer::Busy);
            let key = turn.key().clone();
            let wait = waiting.get_or_insert_with(|| self.backend.clone().wait(&key, mode));
            let nudges = turn.nudges();
            match self
                .between_attempts(&mut backoff, wait, nudges, window)
                .await?
            {
                Next::Attempt => {}
                Next::Granted(acquired, sent) => return Ok(self.hold(caller, turn, acquired, sent)),
            }
        }
    }

    /// After a busy answer: waits for whichever comes first — the backend's wait changing (a
    /// release it saw, or a grant), a local release that freed what the turn waits for, the
    /// next backoff step, the window's end (`Timeout`: the latest answer was "busy"), or the
    /// backend starting to fail (its cause). A backoff step that would end at or after the
    /// deadline is not armed: the deadline ends the wait, and the turn stays with us so local
    /// waiters behind us stay quiet.
    async fn between_attempts<W: Wait<Lease = B::Lease>>(
        &self,
        backoff: &mut Backoff,
        wait: &mut W,
        nudge: Option<Arc<tokio::sync::Notify>>,
        window: &Window,
    ) -> Result<Next<B::Lease>, LockError> {
        let nudged = async {
            match nudge {
                Some(nudge) => nudge.notified().await,
                None => std::future::pending().await,
            }
        };
        let wake = crate::clock::in_(backoff.next_delay());
        tokio::select! {
            biased;
            refusal = self.health.failing() => Err(failing_error(refusal)),
            woken = wait.changed() => match woken {
                Woken::Granted { acquired, sent } => Ok(Next::Granted(acquired, sent)),
                _ => self.attempt_unless_over(window),
            },
            _ = nudged => self.attempt_unless_over(window),
            _ = tokio::time::sleep_until(wake), if wake < window.deadline => Ok(Next::Attempt),
            _ = tokio::time::sleep_until(window.deadline) => Err(LockError::timed_out(window.timeout)),
        }
    }

    /// A wake-up that lands at the deadline starts no attempt: the time is up, and the latest
    /// answer was "busy".
    fn attempt_unless_over(&self, window: &Window) -> Result<Next<B::Lease>, LockError> {
        if window.is_over() {
            Err(LockError::timed_out(window.timeout))
        } else {
            Ok(Next::Attempt)
        }
    }

    /// Waits in the queue for the turn. When the window is over it ends with what is known
    /// about the key — unless nothing is known yet (an attempt or a release in flight), in
    /// which case it waits for that answer, or for the turn, which it then uses for one
    /// attempt. While the backend is failing, it ends at once with the cause.
    async fn queued(&self, ticket: Ticket, window: &Window) -> Result<Turn, LockError> {
        self.telemetry.waiter_queued();
        let _left = Defer(|| self.telemetry.waiter_left());
        let evidence = ticket.evidence_handle();
        let turn = ticket.turn();
        tokio::pin!(turn);
        tokio::select! {
            biased;
            refusal = self.health.failing() => return Err(failing_error(refusal)),
            turn = &mut turn => return Ok(turn),
            _ = tokio::time::sleep_until(window.deadline) => {}
        }
        loop {
            let answer = match evidence.at_deadline() {
                Occupied::Known(known) => return Err(wait_error(known, window.timeout)),
                Occupied::Pending(answer) => answer,
            };
            tokio::select! {
                biased;
                refusal = self.health.failing() => return Err(failing_error(refusal)),
                turn = &mut turn => return Ok(turn),
                known = answer.evidence() => {
                    if let Some(known) = known {
                        return Err(wait_error(known, window.timeout));
                    }
                    // The turn passed on without an answer (a holder's release was answered):
                    // the next party attempts at once, and its answer is the one to wait for.
                }
            }
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
    /// Kept until the release is done: the attempt counts as abandoned and running until then.
    gone: Arc<Gone>,
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
            // Only now is the attempt over (see `abandoned`).
            drop(self.gone);
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

/// Where an acquire call comes from and what it asks for: the mode its hold will be in, the
/// runtime its hold will live on, and the caller's span (a request's, say), which a loss of the
/// hold is logged under.
struct Caller {
    mode: LockMode,
    runtime: tokio::runtime::Handle,
    span: tracing::Span,
}

impl Caller {
    fn here(mode: LockMode, span: tracing::Span) -> Result<Caller, LockError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::new(
                ErrorKind::Misconfigured,
                "LockingKit must run inside a tokio runtime (it renews held locks in the background)",
            )
        })?;
        Ok(Caller {
            mode,
            runtime,
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
