//! One backoff for every connection a backend opens, so that a server that is down, refuses
//! our password or is out of connection slots is not hammered by reconnects.
//!
//! The lock sessions and waiting sessions of one PostgreSQL or MySQL backend connect through
//! the same [`Reconnect`]. After a connect fails, the backend opens no connection for a while
//! and every caller that needs one is told the latest cause at once (the server sees nothing);
//! then one connect at a time is tried, [`OUTAGE_FIRST`] after the failure, each further one
//! twice as long after the last failed one (with equal jitter, so that instances drift apart),
//! up to [`OUTAGE_MOST`] apart. The first connection that opens ends it. The engine logs the
//! outage (once when it starts, once when it ends); this module logs nothing.

use std::future::Future;
use std::sync::Arc;

use tokio::time::Instant;

use crate::backend::BackendError;
use crate::health::{Admission, Health, OUTAGE_FIRST, OUTAGE_MOST};

/// Whether connecting to the server works, shared by every session of a backend.
#[derive(Debug)]
pub(crate) struct Reconnect {
    health: Arc<Health>,
}

impl Reconnect {
    pub(crate) fn new() -> Self {
        Reconnect {
            health: Arc::new(Health::new(OUTAGE_FIRST, OUTAGE_MOST)),
        }
    }

    /// Whether connects are failing now (no connect would be tried).
    pub(crate) fn is_failing(&self) -> bool {
        self.health.is_failing()
    }

    /// The latest connect failure, while connecting is failing.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn current_failure(&self) -> Option<BackendError> {
        self.health.current_failure().map(|refusal| refusal.cause)
    }

    /// Runs `connect` unless connecting is failing and no attempt is due, in which case the
    /// latest failure is returned at once without touching the server.
    pub(crate) async fn connect<T>(
        &self,
        connect: impl Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        let probe = match self.health.admit() {
            Admission::Go => None,
            Admission::Probe(probe) => Some(probe),
            Admission::Refused(refusal) => {
                let now = Instant::now();
                let message = format!(
                    "{} (no connection attempted: connecting has failed for {:?}; the next \
                     attempt is in {:?})",
                    refusal.cause.message(),
                    now.saturating_duration_since(refusal.since),
                    refusal.retry_at.saturating_duration_since(now),
                );
                return Err(refusal.cause.with_message(message).paced_by_provider());
            }
        };
        // Whatever fails here is this gate's to pace (see `BackendError::paced_by_provider`).
        let result = connect.await.map_err(BackendError::paced_by_provider);
        match (&result, probe) {
            (Ok(_), Some(probe)) => {
                probe.answered();
            }
            (Ok(_), None) => {
                self.health.answered();
            }
            (Err(error), Some(probe)) => probe.failed(error),
            (Err(error), None) => {
                self.health.failed(error, false);
            }
        }
        result
    }
}
