//! Leader election: run work on exactly one instance at a time, and hand it over on loss.
//!
//! - `mod.rs` (here): the public surface — [`Campaign`] (what to campaign for and how),
//!   [`Leadership`] (a running campaign), [`Term`] (one stretch of leading) and
//!   [`LeaderState`] (what a health check reads).
//! - `campaign.rs`: the campaign loop: win the lock, lead, end the term, back off, again.
//! - `telemetry.rs`: terms won and ended, as spans and metrics, never keys.
//!
//! Everything here is built on the public engine surface (`DistributedLock::acquire`, the held
//! lock's loss token and fencing token), so it works on every provider unchanged.

mod campaign;
mod telemetry;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use opentelemetry::metrics::Meter;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::LockMode;
#[cfg(doc)]
use crate::error::ErrorKind;
use crate::error::LockError;
use crate::handle::LockView;
use crate::lock::DistributedLock;

/// The first pause between terms (and between failed campaigns), before jitter.
const MIN_RETRY_DELAY: Duration = Duration::from_millis(100);

/// The longest pause between terms (and between failed campaigns), before jitter.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(5);

/// A campaign for leadership of one key: the lock of the key *is* the leadership.
///
/// Made by [`DistributedLock::leader`]; [`start`](Self::start) runs it in the background.
/// The campaign waits for the key's lock (as [`DistributedLock::acquire`] waits, with no
/// timeout), runs the leader work while it holds the lock, and drops that work the moment the
/// lock is lost. Then it pauses — a capped, jittered backoff from 100 ms doubling to 5 s by
/// default, started over after a term that lasted longer than the cap — and campaigns again.
///
/// # Terms
/// Each time the campaign wins the lock a new [`Term`] begins. Its number is the lock's
/// fencing token, so it is strictly greater than every earlier term's, on this instance and on
/// every other: send it with every write the leader makes, and have the resource refuse
/// numbers lower than the highest it has seen. A term ends when the lock is lost (the work is
/// dropped at its current `.await`), when the work returns (the lock is released, so work that
/// should lead for as long as the instance runs loops until it is dropped), or when the
/// campaign is resigned.
///
/// # Errors
/// A campaign goes on through outages and contention: a wait that ends in
/// [`ErrorKind::Unavailable`] (the backend could not be reached, or the provider refuses
/// callers while it is failing), [`ErrorKind::Timeout`] or [`ErrorKind::Busy`] is retried
/// after the backoff. Any other failure — [`ErrorKind::Misconfigured`],
/// [`ErrorKind::Backend`], … — is one no retry can fix, and stops the campaign with that
/// error: [`LeaderState::Stopped`] carries it and [`Leadership::resign`] returns it.
///
/// # Hand-over
/// [`Leadership::resign`] releases the lock at once and waits for the backend to confirm, so a
/// campaign of the same key in another process leads within that provider's
/// `max_retry_delay` (1 s by default) plus one attempt, and one in the same process (the same
/// `DistributedLock`) at once. A leader that dies without resigning is followed once the
/// backend frees its lock — as soon as its connection closes on PostgreSQL, when the lease
/// expires on lease backends — plus the same `max_retry_delay`.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lockingkit::LockError> {
/// use lockingkit::DistributedLock;
///
/// let locks = DistributedLock::in_memory();
/// let leadership = locks.leader("jobs/outbox-relay")?.start(|term| async move {
///     loop {
///         // Relay a batch, fenced by the term: a deposed leader's writes are refused.
///         let _fence = term.number();
///         tokio::time::sleep(std::time::Duration::from_millis(10)).await;
///     }
/// })?;
/// let mut state = leadership.state();
/// state.wait_for(|s| s.is_leading()).await.ok();
/// leadership.resign().await?; // the lock is released before this returns
/// # Ok(()) }
/// ```
#[must_use = "a campaign does nothing until it is started"]
pub struct Campaign {
    locks: DistributedLock,
    key: Arc<str>,
    min_retry_delay: Duration,
    max_retry_delay: Duration,
    meter: Option<Meter>,
}

impl Campaign {
    pub(crate) fn new(locks: DistributedLock, key: &str) -> Self {
        Campaign {
            locks,
            key: Arc::from(key),
            min_retry_delay: MIN_RETRY_DELAY,
            max_retry_delay: MAX_RETRY_DELAY,
            meter: None,
        }
    }

    /// The pause between terms and between failed campaigns: from `min`, doubling to `max`,
    /// each with equal jitter (half fixed, half random). 100 ms and 5 s by default.
    /// [`start`](Self::start) refuses a `min` of zero or above `max`.
    pub fn retry_delays(mut self, min: Duration, max: Duration) -> Self {
        self.min_retry_delay = min;
        self.max_retry_delay = max;
        self
    }

    /// The meter to record terms on, instead of the global provider's `lockingkit` meter.
    pub fn meter(mut self, meter: Meter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// Starts campaigning in a background task on the current tokio runtime, calling `work`
    /// with each [`Term`] this instance wins.
    ///
    /// Fails with [`ErrorKind::Misconfigured`] if the retry delays are invalid or no tokio
    /// runtime is running; nothing is sent then.
    pub fn start<W, F>(self, work: W) -> Result<Leadership, LockError>
    where
        W: FnMut(Term) -> F + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        self.check()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            LockError::new(
                crate::error::ErrorKind::Misconfigured,
                "a campaign runs on a tokio runtime, and none is running here",
            )
        })?;
        let (state_tx, state) = watch::channel(LeaderState::Campaigning);
        let stop = CancellationToken::new();
        let run = campaign::Run::new(self, stop.clone(), state_tx);
        let task = runtime.spawn(run.campaign(work));
        Ok(Leadership {
            state,
            stop,
            task: Some(task),
        })
    }

    fn check(&self) -> Result<(), LockError> {
        if self.min_retry_delay.is_zero() || self.min_retry_delay > self.max_retry_delay {
            return Err(LockError::new(
                crate::error::ErrorKind::Misconfigured,
                format!(
                    "a campaign's retry delays must be above zero with min ({:?}) not above \
                     max ({:?})",
                    self.min_retry_delay, self.max_retry_delay
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for Campaign {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key is left out on purpose: keys routinely carry customer ids.
        f.debug_struct("Campaign")
            .field("lock", &self.locks.name())
            .field("min_retry_delay", &self.min_retry_delay)
            .field("max_retry_delay", &self.max_retry_delay)
            .finish_non_exhaustive()
    }
}

impl DistributedLock {
    /// A campaign for leadership of `key`: run work on exactly one instance at a time (see
    /// [`Campaign`]). Every instance that should be able to lead campaigns for the same key.
    ///
    /// Fails with [`ErrorKind::InvalidKey`] for a key outside 1–512 characters. Nothing is
    /// sent until the campaign starts.
    pub fn leader(&self, key: &str) -> Result<Campaign, LockError> {
        crate::keys::validate_key(key)?;
        self.ensure_supports(LockMode::Exclusive)?;
        Ok(Campaign::new(self.clone(), key))
    }
}

/// What a campaign is doing, as a [`Leadership::state`] watch shows it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum LeaderState {
    /// Not leading: waiting for the lock, or pausing between terms.
    Campaigning,
    /// Leading in term `term` (the lock's fencing token) since `since`, while `lock` is held.
    ///
    /// The watch moves on to `Campaigning` before the campaign sends the term's release. When
    /// the term ends in loss, the engine gives the lock up on its own (and may send a
    /// best-effort release) before the campaign has run to move the watch on: for that moment
    /// the value still reads `Leading`, but [`is_leading`](LeaderState::is_leading) and
    /// [`term`](LeaderState::term) already say no, as they do once the lock's loss deadline
    /// has passed. Ask them, not the variant, whether this instance leads.
    #[non_exhaustive]
    Leading {
        /// The term number: the fencing token of the lock that makes this instance leader.
        term: u64,
        /// When the term began, on tokio's clock.
        since: Instant,
        /// When the term began, on the wall clock (for health endpoints and logs).
        elected_at: SystemTime,
        /// The term's lock, as the leader work's [`Term`] sees it.
        lock: LockView,
    },
    /// The campaign is over: resigned (`error` is `None`) or stopped by a failure no retry
    /// can fix.
    Stopped {
        /// The failure that stopped the campaign, if one did.
        error: Option<LockError>,
    },
}

impl LeaderState {
    /// Whether this instance leads now: in a term whose lock is still held (not lost,
    /// released or past its loss deadline).
    pub fn is_leading(&self) -> bool {
        self.term().is_some()
    }

    /// The current term's number, while leading (see [`is_leading`](Self::is_leading)).
    pub fn term(&self) -> Option<u64> {
        match self {
            LeaderState::Leading { term, lock, .. } if lock.is_held() => Some(*term),
            _ => None,
        }
    }

    /// Whether the campaign is over.
    pub fn is_stopped(&self) -> bool {
        matches!(self, LeaderState::Stopped { .. })
    }
}

/// One term of leadership, handed to the leader work: the held lock, seen through its
/// [`LockView`] (`Deref`), and the term's number.
///
/// The view tells the work everything it needs to stay safe: [`number`](Self::number) to fence
/// writes, [`lost_token`](LockView::lost_token) and [`ensure_held`](LockView::ensure_held) to
/// stop at once in code that outlives the work future (a spawned task). The work future itself
/// is dropped by the campaign when the term ends.
#[derive(Clone)]
pub struct Term {
    view: LockView,
    since: Instant,
}

impl Term {
    /// The term number: the lock's fencing token, strictly greater than every earlier term's.
    pub fn number(&self) -> u64 {
        self.view.fencing_token()
    }

    /// When the term began, on tokio's clock.
    pub fn since(&self) -> Instant {
        self.since
    }
}

impl std::ops::Deref for Term {
    type Target = LockView;

    fn deref(&self) -> &LockView {
        &self.view
    }
}

impl fmt::Debug for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Term")
            .field("number", &self.number())
            .field("is_held", &self.is_held())
            .finish_non_exhaustive()
    }
}

/// A running campaign, made by [`Campaign::start`].
///
/// Dropping it resigns in the background: the campaign stops, the leader work is dropped and
/// the lock released without waiting for the answer. [`resign`](Self::resign) does the same
/// and waits for it.
pub struct Leadership {
    state: watch::Receiver<LeaderState>,
    stop: CancellationToken,
    task: Option<JoinHandle<Result<(), LockError>>>,
}

impl Leadership {
    /// A watch of the campaign's state: leading since when, campaigning, or stopped (with the
    /// error that stopped it). Cheap; clone it into health checks.
    pub fn state(&self) -> watch::Receiver<LeaderState> {
        self.state.clone()
    }

    /// Whether this instance leads now (see [`LeaderState::is_leading`]). It turns `false`
    /// before the lock is given up: before the release is sent when the term's work returns
    /// or the campaign is resigned, and the moment the engine declares the lock lost.
    pub fn is_leading(&self) -> bool {
        self.state.borrow().is_leading()
    }

    /// Stops campaigning: drops the leader work, releases the lock at once and waits for the
    /// backend to confirm, so another instance can take over without waiting for a lease to
    /// expire. Call it as the process shuts down, before
    /// [`DistributedLock::shutdown`](crate::DistributedLock::shutdown).
    ///
    /// `Ok` once resigned. `Err` with the failure that had already stopped the campaign, or
    /// the release's error if the backend did not confirm it (the backend then frees the lock
    /// when the lease expires or the connection closes), or kind [`ErrorKind::Backend`] if the
    /// leader work panicked.
    pub async fn resign(mut self) -> Result<(), LockError> {
        self.stop.cancel();
        let Some(task) = self.task.take() else {
            return Ok(());
        };
        match task.await {
            Ok(result) => result,
            Err(join) => Err(LockError::new(
                crate::error::ErrorKind::Backend,
                format!("the campaign's task ended abnormally: {join}"),
            )),
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("state", &*self.state.borrow())
            .finish_non_exhaustive()
    }
}
