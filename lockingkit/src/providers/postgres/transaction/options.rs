//! Options of transaction-scoped locks.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::super::options::{
    fencing_problems, PostgresOptions, DEFAULT_FENCING_SCHEMA, DEFAULT_FENCING_SEQUENCE,
    DEFAULT_QUERY_TIMEOUT,
};
use crate::config::Problem;
use crate::engine::LockOptions;

/// Options of [`PostgresTransactionLocks`](super::PostgresTransactionLocks), bindable from a
/// configuration section like every option struct.
///
/// The fencing sequence must be the one the session provider uses on the same database, so
/// that tokens grow across both APIs: the defaults are the same, and
/// `PostgresTransactionOptions::from(&postgres_options)` copies the names (and the statement
/// timeout) from a [`PostgresOptions`].
///
/// ```
/// use lockingkit::{PostgresOptions};
/// use lockingkit::providers::postgres::{PostgresTransactionOptions};
///
/// let session =
///     PostgresOptions::new("postgres://app@db.internal/app").with_fencing_schema("locks");
/// let options = PostgresTransactionOptions::from(&session);
/// assert_eq!(options.fencing_schema, "locks");
/// assert_eq!(options.fencing_sequence, "fencing_tokens");
/// assert!(options.problems().is_empty());
/// ```
///
/// Change the defaults with the `with_*` setters; the struct is `#[non_exhaustive]`, so a later
/// release can add a setting without breaking you.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct PostgresTransactionOptions {
    /// The schema of the fencing-token sequence (default `lockingkit`).
    pub fencing_schema: String,
    /// The fencing-token sequence (default `fencing_tokens`).
    pub fencing_sequence: String,
    /// The longest one lock statement may go unanswered (default 5 s); within a wait, also no
    /// longer than the time left until its deadline plus 250 ms. A statement that does not
    /// answer in time ends the call with [`ErrorKind::Unavailable`](crate::ErrorKind).
    #[serde(with = "crate::config::duration")]
    pub query_timeout: Duration,
    /// The first retry delay of a wait (before jitter; default 50 ms).
    #[serde(with = "crate::config::duration")]
    pub min_retry_delay: Duration,
    /// The cap of a wait's retry delay (default 1 s).
    #[serde(with = "crate::config::duration")]
    pub max_retry_delay: Duration,
}

impl Default for PostgresTransactionOptions {
    fn default() -> Self {
        let waiting = LockOptions::default();
        PostgresTransactionOptions {
            fencing_schema: DEFAULT_FENCING_SCHEMA.to_owned(),
            fencing_sequence: DEFAULT_FENCING_SEQUENCE.to_owned(),
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            min_retry_delay: waiting.min_retry_delay,
            max_retry_delay: waiting.max_retry_delay,
        }
    }
}

impl From<&PostgresOptions> for PostgresTransactionOptions {
    /// The fencing sequence and statement timeout of a session provider's options, so both APIs
    /// hand out tokens from one sequence; retry delays keep their defaults.
    fn from(options: &PostgresOptions) -> Self {
        PostgresTransactionOptions {
            fencing_schema: options.fencing_schema.clone(),
            fencing_sequence: options.fencing_sequence.clone(),
            query_timeout: options.query_timeout,
            ..PostgresTransactionOptions::default()
        }
    }
}

impl PostgresTransactionOptions {
    /// Sets [`fencing_schema`](Self::fencing_schema), the schema of the fencing-token sequence.
    /// Default `lockingkit`.
    pub fn with_fencing_schema(mut self, fencing_schema: impl Into<String>) -> Self {
        self.fencing_schema = fencing_schema.into();
        self
    }

    /// Sets [`fencing_sequence`](Self::fencing_sequence), the fencing-token sequence. Default
    /// `fencing_tokens`.
    pub fn with_fencing_sequence(mut self, fencing_sequence: impl Into<String>) -> Self {
        self.fencing_sequence = fencing_sequence.into();
        self
    }

    /// Sets [`query_timeout`](Self::query_timeout), the longest one lock statement may go
    /// unanswered. Default 5 s.
    pub fn with_query_timeout(mut self, query_timeout: Duration) -> Self {
        self.query_timeout = query_timeout;
        self
    }

    /// Sets [`min_retry_delay`](Self::min_retry_delay), the first retry delay of a wait (before
    /// jitter). Default 50 ms.
    pub fn with_min_retry_delay(mut self, delay: Duration) -> Self {
        self.min_retry_delay = delay;
        self
    }

    /// Sets [`max_retry_delay`](Self::max_retry_delay), the cap of a wait's retry delay.
    /// Default 1 s.
    pub fn with_max_retry_delay(mut self, delay: Duration) -> Self {
        self.max_retry_delay = delay;
        self
    }

    /// Lists every problem with these options, each about one of their settings. An empty
    /// list means the options are valid.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = fencing_problems(&self.fencing_schema, &self.fencing_sequence);
        if self.query_timeout.is_zero() {
            problems.push(Problem::new("query_timeout", "must be greater than zero"));
        }
        // The retry delays follow the engine's rules for the same two settings.
        let waiting = LockOptions {
            min_retry_delay: self.min_retry_delay,
            max_retry_delay: self.max_retry_delay,
            ..LockOptions::default()
        };
        problems.extend(waiting.problems());
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid_and_name_the_session_providers_sequence() {
        let options = PostgresTransactionOptions::default();
        assert!(options.problems().is_empty());
        let session = PostgresOptions::default();
        assert_eq!(options.fencing_schema, session.fencing_schema);
        assert_eq!(options.fencing_sequence, session.fencing_sequence);
    }

    #[test]
    fn every_problem_is_listed_with_its_field() {
        let options = PostgresTransactionOptions {
            fencing_schema: "Locks; DROP TABLE x".into(),
            fencing_sequence: String::new(),
            query_timeout: Duration::ZERO,
            min_retry_delay: Duration::from_secs(2),
            max_retry_delay: Duration::from_secs(1),
        };
        let problems = options.problems();
        let fields: Vec<&str> = problems.iter().map(Problem::setting).collect();
        assert_eq!(
            fields,
            [
                "fencing_schema",
                "fencing_sequence",
                "query_timeout",
                "min_retry_delay"
            ],
            "{problems:#?}"
        );
        let zero = PostgresTransactionOptions {
            min_retry_delay: Duration::ZERO,
            ..PostgresTransactionOptions::default()
        };
        assert_eq!(zero.problems().len(), 1);
    }

    #[test]
    fn each_setter_sets_the_setting_of_its_name() {
        let bound: PostgresTransactionOptions = serde_json::from_value(serde_json::json!({
            "fencing_schema": "locks",
            "fencing_sequence": "tokens",
            "query_timeout": "2s",
            "min_retry_delay": "10ms",
            "max_retry_delay": "3s",
        }))
        .unwrap();
        let built = PostgresTransactionOptions::default()
            .with_fencing_schema("locks")
            .with_fencing_sequence("tokens")
            .with_query_timeout(Duration::from_secs(2))
            .with_min_retry_delay(Duration::from_millis(10))
            .with_max_retry_delay(Duration::from_secs(3));
        assert_eq!(built, bound);
    }

    #[test]
    fn options_from_a_session_provider_share_its_sequence_and_timeout() {
        let session = PostgresOptions {
            fencing_schema: "locks".into(),
            fencing_sequence: "tokens".into(),
            query_timeout: Duration::from_secs(2),
            ..PostgresOptions::new("host=localhost")
        };
        let options = PostgresTransactionOptions::from(&session);
        assert_eq!(
            (
                options.fencing_schema.as_str(),
                options.fencing_sequence.as_str()
            ),
            ("locks", "tokens")
        );
        assert_eq!(options.query_timeout, Duration::from_secs(2));
        assert_eq!(
            options.min_retry_delay,
            LockOptions::default().min_retry_delay
        );
    }
}
