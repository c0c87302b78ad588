//! Options every provider shares: how waiters back off and how held locks are kept.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::Problem;

/// Engine options shared by every provider.
///
/// The defaults suit most services: retries start at 50 ms and double to 1 s, renewals run
/// every third of the lease, and a release that gets no answer in 10 s is given up on (the
/// backend then frees the lock when the lease expires or the connection closes). While the
/// backend is failing, callers are refused at once with the latest cause and one attempt at a
/// time is sent, from `min_retry_delay` apart doubling to 1 s.
///
/// Build them from [`LockOptions::default`] with the `with_*` setters; the struct is
/// `#[non_exhaustive]`, so a later release can add a setting without breaking you.
///
/// ```
/// use std::time::Duration;
/// use lockingkit::LockOptions;
///
/// let options = LockOptions::default()
///     .with_max_retry_delay(Duration::from_secs(2))
///     .with_renew_every(Duration::from_secs(5));
/// assert!(options.problems().is_empty());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct LockOptions {
    /// The first retry delay of a waiter (before jitter).
    #[serde(with = "crate::config::duration")]
    pub min_retry_delay: Duration,
    /// The cap of a waiter's retry delay.
    #[serde(with = "crate::config::duration")]
    pub max_retry_delay: Duration,
    /// How often an expiring lease is renewed; `None` means a third of the lease.
    #[serde(with = "crate::config::option_duration")]
    pub renew_every: Option<Duration>,
    /// How long a release may take before it is reported unconfirmed.
    #[serde(with = "crate::config::duration")]
    pub release_timeout: Duration,
    /// The longest a failing backend goes unasked. After an attempt fails (the backend could
    /// not be reached, refused our credentials, answered with a failure of its own), every
    /// caller of this provider is refused at once with that cause, and one attempt at a time
    /// goes out as a probe: the first `min_retry_delay` after the failure, each later one twice
    /// as long after the last failed probe (with equal jitter), up to this or
    /// `min_retry_delay`, whichever is longer, and from then on exactly that far apart: a
    /// backend that is back is asked again within this long. The first answer of any kind ends
    /// the outage.
    #[serde(with = "crate::config::duration")]
    pub max_outage_retry_delay: Duration,
}

impl Default for LockOptions {
    fn default() -> Self {
        LockOptions {
            min_retry_delay: Duration::from_millis(50),
            max_retry_delay: Duration::from_secs(1),
            renew_every: None,
            release_timeout: Duration::from_secs(10),
            max_outage_retry_delay: Duration::from_secs(1),
        }
    }
}

impl LockOptions {
    /// Sets [`min_retry_delay`](Self::min_retry_delay), the first retry delay of a waiter
    /// (before jitter). Default 50 ms.
    pub fn with_min_retry_delay(mut self, delay: Duration) -> Self {
        self.min_retry_delay = delay;
        self
    }

    /// Sets [`max_retry_delay`](Self::max_retry_delay), the cap of a waiter's retry delay.
    /// Default 1 s.
    pub fn with_max_retry_delay(mut self, delay: Duration) -> Self {
        self.max_retry_delay = delay;
        self
    }

    /// Sets [`renew_every`](Self::renew_every), how often an expiring lease is renewed.
    /// Default a third of the lease.
    pub fn with_renew_every(mut self, every: Duration) -> Self {
        self.renew_every = Some(every);
        self
    }

    /// Sets [`release_timeout`](Self::release_timeout), how long a release may take before it
    /// is reported unconfirmed. Default 10 s.
    pub fn with_release_timeout(mut self, timeout: Duration) -> Self {
        self.release_timeout = timeout;
        self
    }

    /// Sets [`max_outage_retry_delay`](Self::max_outage_retry_delay), the longest a failing
    /// backend goes unasked. Default 1 s.
    pub fn with_max_outage_retry_delay(mut self, delay: Duration) -> Self {
        self.max_outage_retry_delay = delay;
        self
    }

    /// Lists every problem with these options, each about one of their settings. An empty
    /// list means the options are valid; [`Problem::at`] places them in a section.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.min_retry_delay.is_zero() {
            problems.push(Problem::new("min_retry_delay", "must be greater than zero"));
        }
        if self.min_retry_delay > self.max_retry_delay {
            problems.push(
                Problem::new("min_retry_delay", "must not exceed {max_retry_delay}")
                    .involving("max_retry_delay")
                    .showing("min_retry_delay", format!("{:?}", self.min_retry_delay))
                    .showing("max_retry_delay", format!("{:?}", self.max_retry_delay)),
            );
        }
        if self.renew_every.is_some_and(|d| d.is_zero()) {
            problems.push(Problem::new("renew_every", "must be greater than zero"));
        }
        if self.release_timeout.is_zero() {
            problems.push(Problem::new("release_timeout", "must be greater than zero"));
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_setter_sets_the_setting_of_its_name() {
        let bound: LockOptions = serde_json::from_value(serde_json::json!({
            "min_retry_delay": "10ms",
            "max_retry_delay": "2s",
            "renew_every": "3s",
            "release_timeout": "4s",
            "max_outage_retry_delay": "5s",
        }))
        .unwrap();
        let built = LockOptions::default()
            .with_min_retry_delay(Duration::from_millis(10))
            .with_max_retry_delay(Duration::from_secs(2))
            .with_renew_every(Duration::from_secs(3))
            .with_release_timeout(Duration::from_secs(4))
            .with_max_outage_retry_delay(Duration::from_secs(5));
        assert_eq!(built, bound);
    }
}
