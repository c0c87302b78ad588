//! How a client treats a backend that is failing: it stops asking everyone's questions and
//! asks one at a time, less and less often, until the backend answers again.
//!
//! A server that refuses connections, rejects our password or hangs is asked nothing useful by
//! a thousand callers a second: each request only adds to its load (a failed login is work for
//! the server, and a fleet of instances retrying at once is a denial of service at the worst
//! moment) and each refusal is the same news. So a [`Health`] records the latest failure, and
//! while it is *current*:
//!
//! - one caller at a time is let through as a **probe**, once the backoff since the last failed
//!   probe has passed: `min` the first time, doubling to `max`, each below the cap with equal
//!   jitter so that instances drift apart, and at the cap exactly `max` apart, so that a sick
//!   server sees at most one probe per `max` from an instance and one that is back is asked
//!   again within `max`;
//! - every other caller is **refused at once with the latest cause**, which costs the backend
//!   nothing and tells the caller the truth (an outage, not contention);
//! - the first answer of any kind (a lock taken, or "busy") ends it.
//!
//! Waiters listen to [`Health::failing`]: a wait that is sleeping or queued when the backend
//! starts failing ends at once with the cause, instead of hanging until its timeout.
//!
//! A gate made with [`Health::logged`] logs the state changes once each (a warning when the
//! backend starts failing, a note with counts when it answers again), never per request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::backend::BackendError;
use crate::backoff::Backoff;

/// The first probe of a provider's own gate (its connects, say) goes out this long after the
/// failure, jittered.
#[cfg_attr(
    not(any(
        feature = "etcd",
        feature = "mysql",
        feature = "postgres",
        feature = "redis"
    )),
    allow(dead_code)
)]
pub(crate) const OUTAGE_FIRST: Duration = Duration::from_millis(100);

/// The most a provider's own gate lets pass between two probes (its connects, say): a sick
/// server is asked at most once in this long, about once a second, and a server that is back
/// is asked again within it, so that service resumes within a second of its return, the
/// connect included.
#[cfg_attr(
    not(any(
        feature = "etcd",
        feature = "mysql",
        feature = "postgres",
        feature = "redis"
    )),
    allow(dead_code)
)]
pub(crate) const OUTAGE_MOST: Duration = Duration::from_millis(900);

/// The failure state of one backend (or of one kind of request to it), shared by its callers.
#[derive(Debug)]
pub(crate) struct Health {
    /// Set while a failure is current: lets the healthy path skip the lock.
    failing: AtomicBool,
    /// Tells waiters when a failure starts (see [`Health::failing`]).
    began: watch::Sender<bool>,
    state: Mutex<Option<Failure>>,
    min: Duration,
    max: Duration,
    /// Who logs the state changes, if anyone: the lock and provider names.
    reporter: Option<(Arc<str>, Arc<str>)>,
}

#[derive(Debug)]
struct Failure {
    cause: BackendError,
    since: Instant,
    /// Requests that failed since `since`.
    failed: u64,
    /// Callers refused without a request since `since`.
    refused: u64,
    backoff: Backoff,
    /// No probe goes out before this.
    retry_at: Instant,
    /// A probe is on its way.
    probing: bool,
}

/// What a caller may do now.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Send the request: the backend is healthy.
    Go,
    /// Send the request as the probe of a failing backend; report its outcome.
    Probe(Probe),
    /// Do not send it: the backend is failing, for this cause (cloned).
    Refused(Refusal),
}

/// A refusal: the latest failure, and when the backend will be asked again.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) cause: BackendError,
    pub(crate) since: Instant,
    pub(crate) retry_at: Instant,
}

/// The right to probe a failing backend. Dropped without an outcome (the request never
/// finished), it lets the next caller probe instead.
#[derive(Debug)]
pub(crate) struct Probe {
    health: Arc<Health>,
    reported: bool,
}

/// The backend answered again after failing.
#[derive(Debug)]
pub(crate) struct Recovered {
    /// How long it was failing.
    pub(crate) after: Duration,
    /// Requests that failed meanwhile.
    pub(crate) failed: u64,
    /// Callers refused without a request meanwhile.
    pub(crate) refused: u64,
}

impl Health {
    /// A gate whose probes back off from `min` to `max`, and which logs nothing.
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Health {
            failing: AtomicBool::new(false),
            began: watch::Sender::new(false),
            state: Mutex::new(None),
            min,
            max: max.max(min),
            reporter: None,
        }
    }

    /// The same, logging each state change once (a warning when the backend starts failing,
    /// a note when it answers again) for the lock `lock` of `provider`.
    pub(crate) fn logged(min: Duration, max: Duration, lock: Arc<str>, provider: Arc<str>) -> Self {
        Health {
            reporter: Some((lock, provider)),
            ..Health::new(min, max)
        }
    }

    fn state(&self) -> MutexGuard<'_, Option<Failure>> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a failure is current.
    pub(crate) fn is_failing(&self) -> bool {
        self.failing.load(Ordering::Acquire)
    }

    /// Resolves once a failure is current (at once if one is): the latest cause, for a waiter
    /// that must end with it rather than hang through the outage.
    pub(crate) fn failing(&self) -> impl std::future::Future<Output = Refusal> + Send + '_ {
        let mut began = self.began.subscribe();
        async move {
            loop {
                if let Some(refusal) = self.current_failure() {
                    return refusal;
                }
                if began.changed().await.is_err() {
                    // The gate is gone with its engine: nothing fails any more.
                    std::future::pending::<()>().await;
                }
            }
        }
    }

    /// The latest failure, if one is current.
    pub(crate) fn current_failure(&self) -> Option<Refusal> {
        if !self.is_failing() {
            return None;
        }
        self.state().as_ref().map(|failure| Refusal {
            cause: failure.cause.clone(),
            since: failure.since,
            retry_at: failure.retry_at,
        })
    }

    /// Whether a request may go out now.
    pub(crate) fn admit(self: &Arc<Self>) -> Admission {
        if !self.is_failing() {
            return Admission::Go;
        }
        let mut state = self.state();
        let Some(failure) = state.as_mut() else {
            return Admission::Go;
        };
        if !failure.probing && Instant::now() >= failure.retry_at {
            failure.probing = true;
            return Admission::Probe(Probe {
                health: self.clone(),
                reported: false,
            });
        }
        failure.refused = failure.refused.saturating_add(1);
        Admission::Refused(Refusal {
            cause: failure.cause.clone(),
            since: failure.since,
            retry_at: failure.retry_at,
        })
    }

    /// A request got an answer (whatever it was): the backend works. `Some` if that ends a
    /// failure.
    pub(crate) fn answered(&self) -> Option<Recovered> {
        if !self.is_failing() {
            return None;
        }
        let failure = self.state().take()?;
        self.failing.store(false, Ordering::Release);
        self.began.send_replace(false);
        let recovered = Recovered {
            after: failure.since.elapsed(),
            failed: failure.failed,
            refused: failure.refused,
        };
        if let Some((lock, provider)) = &self.reporter {
            tracing::info!(
                target: "lockingkit",
                lock = &**lock,
                provider = &**provider,
                failed = recovered.failed,
                refused = recovered.refused,
                "the lock backend answers again after {:?} of failures; {} attempts failed and \
                 {} callers were refused meanwhile",
                recovered.after,
                recovered.failed,
                recovered.refused,
            );
        }
        Some(recovered)
    }

    /// A request failed with `cause`; `probe` says whether it was the probe. `true` if this
    /// starts a failure.
    pub(crate) fn failed(&self, cause: &BackendError, probe: bool) -> bool {
        let mut state = self.state();
        let now = Instant::now();
        match state.as_mut() {
            Some(failure) => {
                failure.cause = cause.clone();
                failure.failed = failure.failed.saturating_add(1);
                // Only the probe moves the schedule: requests sent before the failure began
                // still come back one by one, and each is the same news.
                if probe {
                    failure.probing = false;
                    failure.retry_at = crate::clock::after(now, failure.backoff.next_delay());
                }
                false
            }
            None => {
                let mut backoff = Backoff::new(self.min, self.max).exact_at_cap();
                let retry_in = backoff.next_delay();
                *state = Some(Failure {
                    cause: cause.clone(),
                    since: now,
                    failed: 1,
                    refused: 0,
                    backoff,
                    retry_at: crate::clock::after(now, retry_in),
                    probing: false,
                });
                self.failing.store(true, Ordering::Release);
                drop(state);
                self.began.send_replace(true);
                if let Some((lock, provider)) = &self.reporter {
                    tracing::warn!(
                        target: "lockingkit",
                        lock = &**lock,
                        provider = &**provider,
                        error = %cause,
                        "the lock backend is failing; until it answers again, callers are \
                         refused at once with this cause and one attempt at a time is sent, \
                         first after {retry_in:?}, then less and less often (up to {:?} apart)",
                        self.max,
                    );
                }
                true
            }
        }
    }
}

impl Probe {
    /// The probe got an answer: the backend works again.
    pub(crate) fn answered(mut self) -> Option<Recovered> {
        self.reported = true;
        self.health.answered()
    }

    /// The probe failed with `cause`: the next one waits longer.
    pub(crate) fn failed(mut self, cause: &BackendError) {
        self.reported = true;
        self.health.failed(cause, true);
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        if !self.reported {
            if let Some(failure) = self.health.state().as_mut() {
                failure.probing = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate() -> Arc<Health> {
        Arc::new(Health::new(
            Duration::from_millis(100),
            Duration::from_secs(5),
        ))
    }

    fn refused(admission: &Admission) -> bool {
        matches!(admission, Admission::Refused(_))
    }

    #[tokio::test(start_paused = true)]
    async fn a_healthy_gate_lets_everyone_through() {
        let health = gate();
        for _ in 0..3 {
            assert!(matches!(health.admit(), Admission::Go));
        }
        assert!(health.answered().is_none(), "nothing to recover from");
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_refuses_callers_with_its_cause_until_one_probe_may_go() {
        let health = gate();
        assert!(health.failed(&BackendError::unreachable("refused"), false));
        let failure = health
            .current_failure()
            .expect("the first failure starts the outage");
        let retry_in = failure.retry_at - failure.since;
        assert!(retry_in >= Duration::from_millis(50) && retry_in <= Duration::from_millis(100));
        let Admission::Refused(refusal) = health.admit() else {
            panic!("refused while the backoff runs")
        };
        assert_eq!(refusal.cause.message(), "refused");
        tokio::time::sleep(retry_in).await;
        let probe = match health.admit() {
            Admission::Probe(probe) => probe,
            other => panic!("one probe after the backoff, got {other:?}"),
        };
        assert!(refused(&health.admit()), "only one probe at a time");
        let recovered = probe.answered().expect("an answer ends the outage");
        assert_eq!((recovered.failed, recovered.refused), (1, 2));
        assert!(matches!(health.admit(), Admission::Go));
    }

    #[tokio::test(start_paused = true)]
    async fn failed_probes_double_the_wait_up_to_the_cap() {
        let health = gate();
        health.failed(&BackendError::unreachable("down"), false);
        let mut waits = Vec::new();
        let mut last = Instant::now();
        for _ in 0..10 {
            let probe = loop {
                if let Admission::Probe(probe) = health.admit() {
                    break probe;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            waits.push(last.elapsed());
            last = Instant::now();
            probe.failed(&BackendError::unreachable("down"));
        }
        // Equal jitter below the cap: each wait is between half and all of its delay (plus
        // the 1 ms poll). At the cap, the whole cap: at most one probe per cap, and none later.
        let delays = [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000, 5000];
        for (wait, delay) in waits.iter().zip(delays) {
            let delay = Duration::from_millis(delay);
            let least = if delay == Duration::from_secs(5) {
                delay
            } else {
                delay / 2
            };
            assert!(
                *wait >= least && *wait <= delay + Duration::from_millis(2),
                "waited {wait:?} for a delay of {delay:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_dropped_unanswered_lets_the_next_caller_probe() {
        let health = gate();
        health.failed(&BackendError::unreachable("down"), false);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Admission::Probe(probe) = health.admit() else {
            panic!("probe")
        };
        drop(probe);
        assert!(matches!(health.admit(), Admission::Probe(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn failures_of_requests_sent_before_the_outage_do_not_push_the_probe_back() {
        let health = gate();
        health.failed(&BackendError::unreachable("first"), false);
        let retry_at = health.current_failure().expect("failing").retry_at;
        for _ in 0..20 {
            assert!(!health.failed(&BackendError::unreachable("later"), false));
        }
        let current = health.current_failure().expect("failing");
        assert_eq!(current.retry_at, retry_at);
        assert_eq!(
            current.cause.message(),
            "later",
            "the latest cause is reported"
        );
    }
}
