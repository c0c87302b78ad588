//! The campaign loop: win the lock, lead until the term ends, pause, campaign again.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::telemetry::{LeaderTelemetry, TermEnd};
use super::{Campaign, LeaderState, Term};
use crate::backoff::Backoff;
use crate::error::{ErrorKind, LockError};
use crate::handle::LockHandle;
use crate::lock::DistributedLock;

/// One campaign, as it runs in its task.
pub(super) struct Run {
    locks: DistributedLock,
    key: Arc<str>,
    backoff: Backoff,
    /// A term at least this long starts the backoff over: it was not a flapping lock.
    settled_after: Duration,
    stop: CancellationToken,
    state: watch::Sender<LeaderState>,
    telemetry: LeaderTelemetry,
}

/// How a wait for the lock ended.
enum Won {
    Lock(LockHandle),
    Resigned,
    Failed(LockError),
}

/// Whether a failure to take the lock is worth another campaign: outages and timeouts pass,
/// misconfiguration and failures no retry can fix do not (spinning on them helps nobody).
fn retryable(error: &LockError) -> bool {
    matches!(
        error.kind(),
        ErrorKind::Unavailable | ErrorKind::Timeout | ErrorKind::Busy
    )
}

impl Run {
    pub(super) fn new(
        campaign: Campaign,
        stop: CancellationToken,
        state: watch::Sender<LeaderState>,
    ) -> Self {
        let meter = campaign
            .meter
            .unwrap_or_else(crate::telemetry::global_meter);
        let telemetry =
            LeaderTelemetry::new(campaign.locks.name(), campaign.locks.provider(), &meter);
        Run {
            key: campaign.key,
            backoff: Backoff::new(campaign.min_retry_delay, campaign.max_retry_delay),
            settled_after: campaign.max_retry_delay,
            locks: campaign.locks,
            stop,
            state,
            telemetry,
        }
    }

    /// Campaigns until resigned or stopped by a failure no retry can fix; the state watch
    /// ends in `Stopped` either way.
    pub(super) async fn campaign<W, F>(mut self, mut work: W) -> Result<(), LockError>
    where
        W: FnMut(Term) -> F + Send + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let result = loop {
            let handle = match self.win().await {
                Won::Lock(handle) => handle,
                Won::Resigned => break Ok(()),
                Won::Failed(error) if !retryable(&error) => break Err(error),
                Won::Failed(_) => {
                    if self.pause().await {
                        break Ok(());
                    }
                    continue;
                }
            };
            match self.lead(handle, &mut work).await {
                (TermEnd::Resigned, released) => break released,
                (_, _) => {
                    if self.pause().await {
                        break Ok(());
                    }
                }
            }
        };
        self.state.send_replace(LeaderState::Stopped {
            error: result.as_ref().err().cloned(),
        });
        result
    }

    /// Waits for the lock, for as long as it takes, unless resigned meanwhile (dropping the
    /// wait leaks nothing: the engine releases a lock won by an abandoned attempt).
    async fn win(&self) -> Won {
        tokio::select! {
            biased;
            _ = self.stop.cancelled() => Won::Resigned,
            result = self.locks.acquire(&self.key, Duration::MAX) => match result {
                Ok(handle) => Won::Lock(handle),
                Err(error) => Won::Failed(error),
            },
        }
    }

    /// Leads one term: runs the work with the lock until it is lost, the work returns, or the
    /// campaign is resigned; then ends the hold. Returns how the term ended and, for a
    /// resignation, whether the backend confirmed the release.
    async fn lead<W, F>(
        &mut self,
        handle: LockHandle,
        work: &mut W,
    ) -> (TermEnd, Result<(), LockError>)
    where
        W: FnMut(Term) -> F,
        F: Future<Output = ()>,
    {
        let since = Instant::now();
        let term = Term {
            view: handle.view(),
            since,
        };
        let number = term.number();
        self.state.send_replace(LeaderState::Leading {
            term: number,
            since,
            elected_at: SystemTime::now(),
            lock: handle.view(),
        });
        let span = self.telemetry.term_span(number);
        self.telemetry.term_won();
        let end = async {
            tokio::select! {
                // Resigning wins a tie: the work must not go on once resignation was asked.
                biased;
                _ = self.stop.cancelled() => TermEnd::Resigned,
                result = handle.run(work(term)) => match result {
                    Ok(()) => TermEnd::Finished,
                    Err(_) => TermEnd::Lost,
                },
            }
        }
        .instrument(span.clone())
        .await;
        // The work is dropped by now. The state says "not leading" before the release is
        // sent: the server may grant the next campaigner the moment it frees the lock, before
        // its answer to this release is back, and the two must never both read as leader.
        self.state.send_replace(LeaderState::Campaigning);
        let released = match end {
            TermEnd::Lost => {
                drop(handle);
                Ok(())
            }
            TermEnd::Finished | TermEnd::Resigned => handle.release().await,
        };
        self.telemetry.term_ended(&span, end, since.elapsed());
        if since.elapsed() >= self.settled_after {
            self.backoff.reset();
        }
        (end, released)
    }

    /// Sleeps the next backoff delay; `true` if resigned meanwhile.
    async fn pause(&mut self) -> bool {
        let delay = self.backoff.next_delay();
        tokio::select! {
            biased;
            _ = self.stop.cancelled() => true,
            _ = tokio::time::sleep(delay) => false,
        }
    }
}
