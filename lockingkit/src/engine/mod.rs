//! The engine: waiting, backoff, renewal, loss detection and release, written once for every
//! backend.
//!
//! - `mod.rs` (here): the engine itself, how it is built and validated, and what
//!   `DistributedLock` asks of it (`AnyEngine`), shutdown included.
//! - `acquire.rs`: the acquire path, one loop for every lock mode.
//! - `waiting_room.rs`: how local callers of a key enter, wait, hold and wake one another, per
//!   lock mode (its lanes).
//! - `outcome.rs`: what a caller is told when an acquire does not take the lock.
//! - `hold/`: one held lock, from the acquire that won it to the end of its hold.

mod abandoned;
mod acquire;
mod hold;
mod options;
mod outcome;
mod waiting_room;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use options::LockOptions;

use crate::backend::{BackendError, LeaseTiming, LockBackend, LockMode};
use crate::background::BoxFuture;
use crate::config::Problem;
use crate::error::{ErrorKind, LockError};
use crate::handle::LockHandle;
use crate::health::Health;
use crate::telemetry::{KeyDigest, Telemetry};

use hold::RenewalScheduler;
use outcome::failing_error;
use waiting_room::WaitingRoom;

/// How long a connection-held lock goes unwatched after it is taken (see
/// `Engine::keeper_starts_after`). Loss through a closed connection is declared at most this
/// much later than the backend notices it, and still long before the next check.
const CONNECTION_WATCH_DELAY: Duration = Duration::from_millis(10);

/// The least time an attempt may go unanswered before it counts as an outage (see
/// [`patience`]): a first attempt opens a connection (TLS and authentication included), which
/// on a loaded machine takes far longer than a lock statement.
const LEAST_PATIENCE: Duration = Duration::from_secs(2);

/// How long an attempt may go unanswered before it counts as an outage: the longest retry
/// delay, and never less than [`LEAST_PATIENCE`]. A backend that answers takes far less;
/// one that has not answered by then is down or frozen, and its callers are told so while the
/// attempt finishes in the background.
fn patience(options: &LockOptions) -> Duration {
    options.max_retry_delay.max(LEAST_PATIENCE)
}

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
    /// Callers holding, attempting or waiting for a lock, each counted once.
    fn local_callers(&self) -> usize;
    fn waiting(&self, key: &str) -> usize;
    fn backend_any(&self) -> &(dyn std::any::Any + Send + Sync);
}

pub(crate) struct Engine<B: LockBackend> {
    backend: Arc<B>,
    timing: LeaseTiming,
    options: LockOptions,
    room: Arc<WaitingRoom>,
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

/// Every problem with engine `options` for `backend`: [`problems_with`] its timing, and the
/// writer's intent against the longest pause between attempts. What `DistributedLock::builder`
/// and the registry both check.
pub(crate) fn backend_problems<B: LockBackend>(options: &LockOptions, backend: &B) -> Vec<Problem> {
    let mut problems = problems_with(options, backend.timing(), backend.provider());
    if let Some(intent) = backend.writer_intent() {
        problems.extend(writer_intent_problem(options, intent));
    }
    problems
}

/// The problem of a writer's intent that a waiting writer cannot keep up: it attempts at least
/// once a `max_retry_delay`, and each attempt sets the intent again, so an intent no longer
/// than that lapses between two attempts and lets new readers in.
fn writer_intent_problem(options: &LockOptions, intent: Duration) -> Option<Problem> {
    (intent <= options.max_retry_delay).then(|| {
        Problem::new(
            "writer_intent",
            "must be longer than {max_retry_delay}: a waiting writer sets its intent again at \
             each attempt, and one that lapses between two attempts lets new readers in",
        )
        .involving("max_retry_delay")
        .showing("writer_intent", format!("{intent:?}"))
        .showing("max_retry_delay", format!("{:?}", options.max_retry_delay))
    })
}

/// Every problem with engine `options` for a backend of `timing`, named `provider`: the
/// options' own, and those of their renewal cadence against the backend's leases. The one
/// place these rules live; the registry asks here too.
pub(crate) fn problems_with(
    options: &LockOptions,
    timing: LeaseTiming,
    provider: &str,
) -> Vec<Problem> {
    let mut problems = options.problems();
    match timing {
        // Below a millisecond the keeper would renew or check in a loop that never sleeps
        // (tokio's timers count in milliseconds), and no backend answers that fast anyway.
        LeaseTiming::Expiring(d) if d < SHORTEST_INTERVAL => problems.push(Problem::of_section(
            format!("the backend's lease duration ({d:?}) must be at least {SHORTEST_INTERVAL:?}"),
        )),
        LeaseTiming::ConnectionHeld(d) if d < SHORTEST_INTERVAL => {
            problems.push(Problem::of_section(format!(
                "the backend's check interval ({d:?}) must be at least {SHORTEST_INTERVAL:?}"
            )))
        }
        LeaseTiming::Expiring(d) => {
            if let Some(every) = options.renew_every.filter(|e| *e < SHORTEST_INTERVAL) {
                problems.push(Problem::new(
                    "renew_every",
                    format!("({every:?}) must be at least {SHORTEST_INTERVAL:?}"),
                ));
            }
            if let Some(every) = options.renew_every {
                if every >= crate::clock::nine_tenths(d) {
                    problems.push(
                        Problem::new(
                            "renew_every",
                            format!("({every:?}) must be shorter than 90% of the lease ({d:?})"),
                        )
                        .involving("lease_duration"),
                    );
                }
            }
        }
        LeaseTiming::ConnectionHeld(_) => {
            // The engine would have nothing to do with it, and a setting that silently does
            // nothing misleads whoever tunes it.
            if options.renew_every.is_some() {
                problems.push(renew_every_does_not_apply(provider));
            }
        }
    }
    problems
}

/// The problem of a renewal cadence set on a provider whose locks are not leases.
pub(crate) fn renew_every_does_not_apply(provider: &str) -> Problem {
    Problem::new(
        "renew_every",
        format!(
            "does not apply to the {provider} provider: its locks are held by a connection, \
             which the provider checks on its own interval, not renewed as leases (remove it)"
        ),
    )
}

impl<B: LockBackend> Engine<B> {
    pub(crate) fn new(
        name: &str,
        backend: B,
        options: LockOptions,
        meter: &opentelemetry::metrics::Meter,
        key_digest: Option<KeyDigest>,
    ) -> Result<Self, LockError> {
        let problems = backend_problems(&options, &backend);
        if !problems.is_empty() {
            return Err(crate::config::misconfigured_at(
                &format!("Locking.{name}"),
                problems,
            ));
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
            room: Arc::new(WaitingRoom::new(patience(&options))),
            options,
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

    /// See [`AnyEngine::shutdown`]. Holds give their locks up through their keepers (started
    /// now for those still waiting for theirs), so a release answers as it does for a dropped
    /// handle; the engine is done once no key has an active party any more: every hold ended,
    /// every attempt (an orphaned one's clean-up included) finished.
    async fn shut_down(&self, timeout: Duration) -> Result<(), LockError> {
        let deadline = crate::clock::in_(timeout);
        self.closed.cancel();
        self.scheduler.start_all();
        // Nothing signals the last turn's end, and a shutdown is rare: look every few ms.
        while AnyEngine::local_callers(self) > 0 {
            if Instant::now() >= deadline {
                return Err(LockError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "the shutdown did not finish within {timeout:?}: {} locks or attempts \
                         were still outstanding (their leases expire, or their connections \
                         close, at the backend)",
                        AnyEngine::local_callers(self)
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

    fn local_callers(&self) -> usize {
        self.room.local_callers()
    }

    fn waiting(&self, key: &str) -> usize {
        self.room.waiting(key)
    }

    fn backend_any(&self) -> &(dyn std::any::Any + Send + Sync) {
        &*self.backend
    }
}
