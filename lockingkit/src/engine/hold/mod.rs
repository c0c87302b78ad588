//! One held lock, from the acquire that won it to the end of its hold.
//!
//! # The hold's state machine
//!
//! ```text
//!                 release()            ┌────────────┐  backend answers   turn passes,
//!            ┌───────────────────────▶ │ RELEASING  │ ─────────────────▶ result to caller
//!            │                         └────────────┘
//! ┌──────┐   │  handle dropped         ┌────────────┐  backend answers   turn passes
//! │ HELD │ ──┼───────────────────────▶ │  DROPPED   │ ─────────────────▶ (in the background)
//! └──────┘   │                         └────────────┘
//!            │  keeper gives up        ┌────────────┐  turn passes at once, then a
//!            └───────────────────────▶ │ LOST(why)  │  best-effort release at the backend
//!                                      └────────────┘
//! ```
//!
//! - **HELD** is the only state with a way out, and exactly one transition leaves it, decided
//!   by one compare-and-swap ([`Hold::claim`]): release, drop and loss can race, and the lock
//!   is given up once. Every transition fires the lost token before anything else, so work tied
//!   to it stops before the lock is given up.
//! - While HELD the hold is entered in the [`RenewalScheduler`] (`schedule.rs`) until its
//!   first renewal is due; only then does its keeper task start (`keeper.rs`). The keeper renews
//!   an expiring lease, or checks a held connection, and moves the hold to LOST when it can no
//!   longer vouch for it: the backend says the lease is gone, the connection ended, or the loss
//!   deadline passed.
//! - The **loss deadline** is 90% of the lease after the last successful renewal was *sent*.
//!   A HELD hold past its deadline already answers `is_held() == false` with reason `deadline`,
//!   whether or not its keeper has run: a starved runtime cannot stretch a hold.
//! - Ending a hold ([`Hold::finish`]) records its telemetry and passes the key's turn to the
//!   next local waiter. After release or drop that happens once the backend answered, so the
//!   next local holder never overlaps; after loss it happens at once, since who holds the key
//!   next is the backend's call and the loss may be a hung server.

use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::waiting_room::Turn;
use super::Engine;
use crate::backend::{Acquired, LeaseTiming, LockBackend, LockMode};
use crate::background::{traced, within, within_noting, Orphanable};
use crate::error::{ErrorKind, LockError};
use crate::handle::AnyHold;
use crate::telemetry::{HoldLabels, LossReason};

mod keeper;
mod schedule;

pub(crate) use schedule::RenewalScheduler;

/// The states of the diagram above, in one byte.
const HELD: u8 = 0;
/// `release()` claimed the lock and releases it inline.
const RELEASING: u8 = 1;
/// The handle was dropped; the keeper task releases in the background.
const DROPPED: u8 = 2;
/// The keeper declared the lock lost; the reason is `state - LOST`. Packing the reason into the
/// state byte lets whoever sees the lock lost also see why in the same load, with no second
/// field to order against the claim.
const LOST: u8 = 3;

fn lost_state(reason: LossReason) -> u8 {
    LOST + reason as u8
}

/// The engine's record of one held lock, shared by its `LockHandle`, its keeper and the
/// renewal schedule.
pub(crate) struct Hold<B: LockBackend> {
    pub(super) engine: Arc<Engine<B>>,
    key: Arc<str>,
    mode: LockMode,
    fencing_token: u64,
    pub(super) lease: B::Lease,
    /// Fires on loss and on release; the keeper task stops when it fires. Made on first use
    /// (see [`Hold::lost_signal`]): most holds end before anyone asks for it, and an eager token
    /// costs an allocation and two locked tree updates on every acquire+release pair — what
    /// the benchmark's row 3 (in-memory pairs per second) measures.
    lost: OnceLock<CancellationToken>,
    state: AtomicU8,
    /// The monotonic instant the acquiring request was sent: deadlines are offsets from it,
    /// the keeper is due a fixed delay after it, and the hold's duration counts from it.
    origin: Instant,
    /// The loss deadline, in nanoseconds after `origin`.
    deadline_nanos: AtomicU64,
    turn: Mutex<Option<Turn>>,
    /// The runtime the lock was taken on; drop releases and keepers run there.
    runtime: Handle,
    /// The key's digest, if the host asked for digests (see `telemetry::KeyDigest`).
    key_digest: Option<Box<str>>,
    /// The caller's span when the lock was taken (a request's, say), which its loss is logged
    /// under; `Span::none()` when nobody traces.
    parent: tracing::Span,
}

/// The instant at which an expiring lease must be considered lost: 90% of the lease after the
/// request that last started it was sent. The backend started its lease no earlier than that
/// send, so this is a 10% safety margin before it could expire there, valid while the client's
/// clock runs within 10% of the backend's.
pub(crate) fn loss_deadline(sent: Instant, lease: Duration) -> Instant {
    crate::clock::after(sent, crate::clock::nine_tenths(lease))
}

/// The loss deadline after a successful acquire or check sent at `sent`.
pub(crate) fn deadline_after(timing: LeaseTiming, sent: Instant) -> Instant {
    match timing {
        LeaseTiming::Expiring(lease) => loss_deadline(sent, lease),
        // The next check starts one interval later and must answer within another.
        LeaseTiming::ConnectionHeld(interval) => {
            crate::clock::after(sent, interval.saturating_mul(2))
        }
    }
}

impl<B: LockBackend> Hold<B> {
    pub(super) fn new(
        engine: Arc<Engine<B>>,
        mode: LockMode,
        runtime: Handle,
        turn: Turn,
        acquired: Acquired<B::Lease>,
        sent: Instant,
        parent: tracing::Span,
    ) -> Self {
        let deadline = deadline_after(engine.timing, sent);
        let key_digest = engine.telemetry.key_digest(turn.key());
        Hold {
            key_digest,
            parent,
            runtime,
            key: turn.key().clone(),
            mode,
            fencing_token: acquired.fencing_token,
            lease: acquired.lease,
            lost: OnceLock::new(),
            state: AtomicU8::new(HELD),
            origin: sent,
            deadline_nanos: AtomicU64::new(nanos_between(sent, deadline)),
            turn: Mutex::new(Some(turn)),
            engine,
        }
    }

    pub(super) fn set_deadline(&self, deadline: Instant) {
        self.deadline_nanos
            .store(nanos_between(self.origin, deadline), Ordering::Release);
    }

    fn deadline(&self) -> Instant {
        crate::clock::after(
            self.origin,
            Duration::from_nanos(self.deadline_nanos.load(Ordering::Acquire)),
        )
    }

    /// The token that fires when the hold ends (loss, release or drop), made on first use.
    pub(super) fn lost_signal(&self) -> &CancellationToken {
        let token = self.lost.get_or_init(CancellationToken::new);
        // Pairs with the fence in `claim`: either the claimer sees this token and cancels it,
        // or this load sees the claim. A token made after the hold ended starts cancelled.
        fence(Ordering::SeqCst);
        if self.state.load(Ordering::Acquire) != HELD {
            token.cancel();
        }
        token
    }

    /// Moves the lock out of `HELD` and fires the lost token; only one caller ever succeeds.
    fn claim(&self, to: u8) -> bool {
        let claimed = self
            .state
            .compare_exchange(HELD, to, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if claimed {
            // The hold is ending, so it will not start a keeper any more.
            self.engine.scheduler.left();
            fence(Ordering::SeqCst);
            if let Some(token) = self.lost.get() {
                token.cancel();
            }
        }
        claimed
    }

    /// Ends the hold: telemetry, then the turn passes to the next local waiter.
    fn finish(&self, lost: Option<LossReason>) {
        let labels = HoldLabels {
            fencing_token: self.fencing_token,
            key_digest: self.key_digest.as_deref(),
            parent: &self.parent,
        };
        self.engine
            .telemetry
            .lock_ended(self.origin.elapsed(), lost, labels);
        let turn = self
            .turn
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(turn);
    }

    /// Tells the key's waiting room that the release is on its way.
    fn note_releasing(&self) {
        if let Some(turn) = &*self.turn.lock().unwrap_or_else(PoisonError::into_inner) {
            turn.note_sent(Instant::now());
        }
    }

    /// Releases at the backend; the caller has already claimed the lock.
    pub(super) async fn release_claimed(&self) -> Result<(), LockError> {
        let telemetry = &self.engine.telemetry;
        let span = telemetry.release_span(self.fencing_token, self.key_digest.as_deref());
        let timeout = self.engine.options.release_timeout;
        // Pinned where it is made and handed on by reference: each layer that took it by value
        // would copy the backend's future once more on every release.
        let release = std::pin::pin!(self.engine.backend.release(&self.lease));
        // A release that does not answer at once is on its way: callers that meet the key
        // learn of it, and one unanswered for longer than the engine's patience is an outage,
        // to them (not a holder they should call busy, see the waiting room) and to the
        // outage gate, which then refuses every caller at once rather than let waiters queued
        // behind the release hang until their deadlines.
        let overdue = || {
            let cause = super::outcome::unanswered_release(self.engine.room.patience());
            self.engine.health.failed(&cause, false);
        };
        let limited = std::pin::pin!(within_noting(
            timeout,
            release,
            || self.note_releasing(),
            (self.engine.room.patience(), overdue),
        ));
        let result = traced(span.clone(), limited).await;
        let result = match result {
            Some(Ok(())) => Ok(()),
            Some(Err(error)) => Err(error.into_lock_error()),
            None => Err(LockError::new(
                ErrorKind::Unavailable,
                format!("the backend did not confirm the release within {timeout:?}"),
            )),
        };
        telemetry.release_finished(&span, &result);
        // A backend that answers "lease gone" to the release says the lock was lost before we
        // gave it up: the hold ended in loss, whatever the caller intended.
        let lost = matches!(&result, Err(e) if e.kind() == ErrorKind::Lost)
            .then_some(LossReason::LeaseGone);
        self.finish(lost);
        result
    }

    /// Called by the keeper when the engine shuts down: gives the lock up as a dropped handle
    /// would (the lost token fires first), unless it was released or lost meanwhile.
    pub(super) async fn release_at_shutdown(&self) {
        if self.claim(DROPPED) {
            let _ = self.release_claimed().await;
        }
    }

    /// Called by the keeper when it can no longer vouch for the lock.
    pub(super) async fn declare_lost(&self, reason: LossReason) {
        if !self.claim(lost_state(reason)) {
            // Released or dropped meanwhile: whoever claimed it releases it.
            return;
        }
        // The turn passes on first. Who holds the key next is the backend's call, not this
        // process's, and the release below can hang as long as the fault that caused the loss
        // (a frozen server, a silent network): local waiters must not wait for it. Releases
        // name their lease, so this one can never free a lease a later holder took.
        self.finish(Some(reason));
        // Best effort: after a deadline loss the lease may still be ours at the backend, and
        // giving it up now lets the next holder in before it would expire. After other losses
        // it lets the backend clean up (a PostgreSQL provider discards the broken connection).
        let timeout = self.engine.options.release_timeout;
        let _ = within(timeout, self.engine.backend.release(&self.lease)).await;
    }
}

impl<B: LockBackend> AnyHold for Hold<B> {
    fn key(&self) -> &str {
        &self.key
    }

    fn mode(&self) -> LockMode {
        self.mode
    }

    fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    fn lost_token(&self) -> &CancellationToken {
        self.lost_signal()
    }

    fn is_held(&self) -> bool {
        // Checking the deadline here, not only in the keeper task, keeps the answer honest even
        // when the runtime is too busy to run the keeper on time.
        self.state.load(Ordering::Acquire) == HELD
            && before_deadline(Instant::now(), self.deadline())
    }

    fn loss_reason(&self) -> Option<LossReason> {
        let state = self.state.load(Ordering::Acquire);
        match state {
            HELD if !before_deadline(Instant::now(), self.deadline()) => Some(LossReason::Deadline),
            HELD | RELEASING | DROPPED => None,
            lost => LossReason::ALL.get(usize::from(lost - LOST)).copied(),
        }
    }

    fn release(self: Arc<Self>) -> Orphanable<Result<(), LockError>> {
        if !self.claim(RELEASING) {
            let error = LockError::lost(self.loss_reason());
            // The caller asked to release and is told it failed; the trace should say so too.
            let telemetry = &self.engine.telemetry;
            let span = telemetry.release_span(self.fencing_token, self.key_digest.as_deref());
            let result = Err(error);
            telemetry.release_finished(&span, &result);
            return Orphanable::finishing(std::future::ready(result));
        }
        Orphanable::finishing(async move { self.release_claimed().await })
    }

    fn release_in_background(self: Arc<Self>) {
        if self.claim(DROPPED) {
            let runtime = self.runtime.clone();
            // If the runtime is gone, the task is dropped unrun; the lease then expires or the
            // connection closes with the lease, which frees the lock at the backend.
            runtime.spawn(async move {
                let _ = self.release_claimed().await;
            });
        }
    }

    fn lease(&self) -> &(dyn std::any::Any + Send + Sync) {
        &self.lease
    }

    fn engine_address(&self) -> usize {
        Arc::as_ptr(&self.engine).cast::<()>() as usize
    }

    fn key_digest(&self) -> Option<&str> {
        self.key_digest.as_deref()
    }
}

/// Whether a hold whose loss deadline is `deadline` is still held at `now`. The deadline instant
/// itself is already loss: the margin before the lease could expire is spent.
fn before_deadline(now: Instant, deadline: Instant) -> bool {
    now < deadline
}

fn nanos_between(earlier: Instant, later: Instant) -> u64 {
    u64::try_from(later.saturating_duration_since(earlier).as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_instant_itself_is_loss() {
        let deadline = Instant::now() + Duration::from_secs(27);
        assert!(before_deadline(
            deadline - Duration::from_nanos(1),
            deadline
        ));
        assert!(!before_deadline(deadline, deadline));
        assert!(!before_deadline(
            deadline + Duration::from_nanos(1),
            deadline
        ));
    }

    #[test]
    fn a_30s_lease_is_lost_27s_after_the_send() {
        let sent = Instant::now();
        assert_eq!(
            loss_deadline(sent, Duration::from_secs(30)),
            sent + Duration::from_secs(27)
        );
        assert_eq!(
            deadline_after(LeaseTiming::ConnectionHeld(Duration::from_secs(5)), sent),
            sent + Duration::from_secs(10)
        );
    }
}
