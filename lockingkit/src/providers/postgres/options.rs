//! Options of the PostgreSQL provider.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::connection;
use crate::config::{Problem, SecretString, WholeNumbers};

/// Options of the PostgreSQL provider, bindable from a `Locking.{name}` configuration section.
///
/// ```
/// use std::time::Duration;
/// use lockingkit::PostgresOptions;
///
/// let options = PostgresOptions::new("postgres://app:secret@db.internal/app?sslmode=verify-full")
///     .with_max_sessions(2)
///     .with_check_interval(Duration::from_secs(2));
/// assert!(options.problems().is_empty());
/// assert!(!format!("{options:?}").contains("secret"));
/// ```
///
/// Held locks share sessions: a backend opens at most `max_sessions` connections for its locks
/// however many it holds, plus at most `max_wait_sessions` while it waits for keys held by
/// other processes (see the connection budget in the PostgreSQL guide).
///
/// Build them with [`PostgresOptions::new`] and the `with_*` setters; the struct is
/// `#[non_exhaustive]`, so a later release can add a setting without breaking you.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct PostgresOptions {
    /// A libpq connection string, as a URL (`postgres://user:pass@host:5432/db?sslmode=require`)
    /// or as `key=value` pairs. `sslmode` is one of `disable`, `prefer` (the default),
    /// `require`, `verify-ca` or `verify-full`, with libpq's meanings; `sslrootcert` names a PEM
    /// file whose certificates are the only trusted roots (without it, `verify-*` trusts the
    /// platform's store).
    pub connection_string: SecretString,
    /// The most sessions (connections) the backend opens for its locks. Every held lock lives
    /// on one of them, each session holding any number of locks; attempts, unlocks and checks
    /// are pipelined on them. More sessions spread the work over more server processes.
    pub max_sessions: usize,
    /// The most sessions the backend opens to learn the moment a key it waits for is freed by
    /// another process (one per key waited for; waits beyond this poll). Open only while
    /// someone waits.
    pub max_wait_sessions: usize,
    /// How often a held lock's connection is checked; a check that fails or does not answer
    /// within this interval is loss.
    #[serde(with = "crate::config::duration")]
    pub check_interval: Duration,
    /// The longest any one statement, connection attempt or wait for a pooled connection may
    /// take. A frozen server would otherwise hang a call forever.
    #[serde(with = "crate::config::duration")]
    pub query_timeout: Duration,
    /// The schema of the fencing-token sequence; created on first use if missing.
    pub fencing_schema: String,
    /// The fencing-token sequence; created on first use if missing.
    pub fencing_sequence: String,
}

/// The default session budget for held locks and attempts.
pub(crate) const DEFAULT_MAX_SESSIONS: usize = 4;
/// The default budget of sessions that wait for keys held by other processes.
pub(crate) const DEFAULT_MAX_WAIT_SESSIONS: usize = 16;
/// The default connection check interval.
pub(crate) const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// The default statement timeout.
pub(crate) const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// The default schema of the fencing-token sequence.
pub const DEFAULT_FENCING_SCHEMA: &str = "lockingkit";
/// The default name of the fencing-token sequence.
pub const DEFAULT_FENCING_SEQUENCE: &str = "fencing_tokens";

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions {
            connection_string: SecretString::default(),
            max_sessions: DEFAULT_MAX_SESSIONS,
            max_wait_sessions: DEFAULT_MAX_WAIT_SESSIONS,
            check_interval: DEFAULT_CHECK_INTERVAL,
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            fencing_schema: DEFAULT_FENCING_SCHEMA.to_owned(),
            fencing_sequence: DEFAULT_FENCING_SEQUENCE.to_owned(),
        }
    }
}

impl PostgresOptions {
    /// The ranges of the session budgets. A backend's sessions are server connections, of which
    /// PostgreSQL allows 100 by default in all: more than a thousand per backend is a mistake.
    pub(crate) const WHOLE_NUMBERS: &'static [WholeNumbers] = &[
        WholeNumbers {
            setting: "max_sessions",
            min: 1,
            max: 1024,
        },
        WholeNumbers {
            setting: "max_wait_sessions",
            min: 0,
            max: 1024,
        },
    ];

    /// Default options for `connection_string`.
    pub fn new(connection_string: impl Into<SecretString>) -> Self {
        PostgresOptions {
            connection_string: connection_string.into(),
            ..PostgresOptions::default()
        }
    }

    /// Sets [`connection_string`](Self::connection_string), the libpq connection string.
    /// Required; empty by default.
    pub fn with_connection_string(mut self, connection_string: impl Into<SecretString>) -> Self {
        self.connection_string = connection_string.into();
        self
    }

    /// Sets [`max_sessions`](Self::max_sessions), the most sessions the backend opens for its
    /// locks (1–1024). Default 4.
    pub fn with_max_sessions(mut self, max_sessions: usize) -> Self {
        self.max_sessions = max_sessions;
        self
    }

    /// Sets [`max_wait_sessions`](Self::max_wait_sessions), the most sessions the backend opens
    /// to wait for keys held by other processes (0–1024). Default 16.
    pub fn with_max_wait_sessions(mut self, max_wait_sessions: usize) -> Self {
        self.max_wait_sessions = max_wait_sessions;
        self
    }

    /// Sets [`check_interval`](Self::check_interval), how often a held lock's connection is
    /// checked. Default 5 s.
    pub fn with_check_interval(mut self, check_interval: Duration) -> Self {
        self.check_interval = check_interval;
        self
    }

    /// Sets [`query_timeout`](Self::query_timeout), the longest any one statement, connection
    /// attempt or wait for a pooled connection may take. Default 5 s.
    pub fn with_query_timeout(mut self, query_timeout: Duration) -> Self {
        self.query_timeout = query_timeout;
        self
    }

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

    /// Lists every problem with these options, each about one of their settings. An empty
    /// list means the options are valid. No problem quotes the connection string.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.connection_string.is_blank() {
            problems.push(Problem::new("connection_string", "is required"));
        } else if let Err(problem) = connection::parse(self.connection_string.expose()) {
            problems.push(Problem::detail("connection_string", problem));
        }
        for (range, value) in Self::WHOLE_NUMBERS
            .iter()
            .zip([self.max_sessions, self.max_wait_sessions])
        {
            problems.extend(range.check(u64::try_from(value).unwrap_or(u64::MAX)));
        }
        if self.check_interval.is_zero() {
            problems.push(Problem::new("check_interval", "must be greater than zero"));
        }
        if self.query_timeout.is_zero() {
            problems.push(Problem::new("query_timeout", "must be greater than zero"));
        }
        problems.extend(fencing_problems(
            &self.fencing_schema,
            &self.fencing_sequence,
        ));
        problems
    }
}

/// The problems with a fencing schema and sequence name, for every option struct that names
/// them: they are spliced into SQL, so only plain identifiers pass.
pub(super) fn fencing_problems(schema: &str, sequence: &str) -> Vec<Problem> {
    [("fencing_schema", schema), ("fencing_sequence", sequence)]
        .into_iter()
        .filter(|(_, value)| !is_plain_identifier(value))
        .map(|(field, _)| {
            Problem::new(
                field,
                "must be a lowercase SQL identifier of at most 63 characters (letters, digits, \
                 _; not starting with a digit)",
            )
        })
        .collect()
}

/// An identifier PostgreSQL keeps as written without quotes, so it can be spliced into SQL
/// with no quoting rules to get wrong.
fn is_plain_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some('a'..='z' | '_'))
        && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
        && name.len() <= 63
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_need_only_a_connection_string() {
        assert_eq!(
            PostgresOptions::default().problems(),
            vec![Problem::new("connection_string", "is required")]
        );
        assert!(PostgresOptions::new("host=localhost user=app")
            .problems()
            .is_empty());
    }

    #[test]
    fn every_problem_is_listed_without_the_secret() {
        let options = PostgresOptions {
            connection_string: "postgres://app:hunter2@db/app?sslmode=hunter2".into(),
            max_sessions: 0,
            max_wait_sessions: 0,
            check_interval: Duration::ZERO,
            query_timeout: Duration::ZERO,
            fencing_schema: "Locks; DROP TABLE x".into(),
            fencing_sequence: String::new(),
        };
        let problems = options.problems();
        assert_eq!(problems.len(), 6, "{problems:#?}");
        let shown: Vec<String> = problems
            .into_iter()
            .map(|p| p.at("Locking.Jobs").to_string())
            .collect();
        assert!(shown.iter().all(|p| p.starts_with("Locking.Jobs.")));
        assert!(shown.iter().all(|p| !p.contains("hunter2")));
        assert!(!format!("{options:?}").contains("hunter2"));
    }

    #[test]
    fn each_setter_sets_the_setting_of_its_name() {
        let bound: PostgresOptions = serde_json::from_value(serde_json::json!({
            "connection_string": "host=db user=app",
            "max_sessions": 2,
            "max_wait_sessions": 3,
            "check_interval": "4s",
            "query_timeout": "6s",
            "fencing_schema": "locks",
            "fencing_sequence": "tokens",
        }))
        .unwrap();
        let built = PostgresOptions::default()
            .with_connection_string("host=db user=app")
            .with_max_sessions(2)
            .with_max_wait_sessions(3)
            .with_check_interval(Duration::from_secs(4))
            .with_query_timeout(Duration::from_secs(6))
            .with_fencing_schema("locks")
            .with_fencing_sequence("tokens");
        assert_eq!(built, bound);
    }

    #[test]
    fn identifiers_are_plain_lowercase_names() {
        assert!(is_plain_identifier("lockingkit"));
        assert!(is_plain_identifier("_fencing_2"));
        assert!(!is_plain_identifier("2fencing"));
        assert!(!is_plain_identifier("Fencing"));
        assert!(!is_plain_identifier("a\"b"));
        assert!(!is_plain_identifier(&"a".repeat(64)));
    }
}
