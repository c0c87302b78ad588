//! Options of the MySQL and MariaDB provider.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{Problem, SecretString, WholeNumbers};

/// Options of the MySQL and MariaDB provider, bindable from a `Locking.{name}` configuration
/// section with `provider = "mysql"`.
///
/// ```
/// use std::time::Duration;
/// use lockingkit::MysqlOptions;
///
/// let options = MysqlOptions::new("mysql://app:secret@db.internal:3306/app?require_ssl=true")
///     .with_max_sessions(4)
///     .with_check_interval(Duration::from_secs(2));
/// assert!(options.problems().is_empty());
/// assert!(!format!("{options:?}").contains("secret"));
/// ```
///
/// Held locks share sessions: a backend opens at most `max_sessions` sessions for its locks
/// however many it holds, plus at most `max_wait_sessions` while it waits for keys held by
/// other processes, and each session has a sentinel connection that notices at once when the
/// server ends it: at most `2 × (max_sessions + max_wait_sessions)` connections (see the
/// connection budget in the MySQL guide).
///
/// Build them with [`MysqlOptions::new`] and the `with_*` setters; the struct is
/// `#[non_exhaustive]`, so a later release can add a setting without breaking you.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct MysqlOptions {
    /// A `mysql://user:password@host:port/database` URL, with mysql_async's query parameters:
    /// `require_ssl=true` for TLS, `verify_ca` and `verify_identity` (both `true` unless set
    /// to `false`) for what TLS checks, `tcp_keepalive` (milliseconds). The database holds the
    /// fencing table. The connection goes to the host and port named, never to the server's
    /// unix socket unless the URL asks for it with `prefer_socket=true`.
    pub connection_string: SecretString,
    /// The most sessions the backend opens for its locks. Every held lock lives on one of
    /// them, each session holding any number of locks; a session runs one statement at a time,
    /// so more sessions let more attempts and releases run at once. Each session is two
    /// connections: itself and its sentinel.
    pub max_sessions: usize,
    /// The most sessions the backend opens to wait for keys held by other processes, each
    /// blocked in `GET_LOCK` for one key in bounded slices (waits beyond this poll). A lock a
    /// waiting session is granted stays on it until released. Open only while someone waits.
    pub max_wait_sessions: usize,
    /// How often a held lock's session is checked; a check that fails or does not answer
    /// within this interval is loss.
    #[serde(with = "crate::config::duration")]
    pub check_interval: Duration,
    /// The longest any one statement or connection attempt may take. A frozen server would
    /// otherwise hang a call forever. A statement that is not answered in time ends its
    /// session, and with it every lock the session held.
    #[serde(with = "crate::config::duration")]
    pub query_timeout: Duration,
    /// The InnoDB table of the fencing tokens' epoch, in the connection's database; created
    /// on first use if missing.
    pub fencing_table: String,
}

/// The default session budget for held locks and attempts.
pub(crate) const DEFAULT_MAX_SESSIONS: usize = 4;
/// The default budget of sessions that wait for keys held by other processes.
pub(crate) const DEFAULT_MAX_WAIT_SESSIONS: usize = 8;
/// The default session check interval.
pub(crate) const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// The default statement timeout.
pub(crate) const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// The default fencing-token table.
pub const DEFAULT_FENCING_TABLE: &str = "lockingkit_fencing";

impl Default for MysqlOptions {
    fn default() -> Self {
        MysqlOptions {
            connection_string: SecretString::default(),
            max_sessions: DEFAULT_MAX_SESSIONS,
            max_wait_sessions: DEFAULT_MAX_WAIT_SESSIONS,
            check_interval: DEFAULT_CHECK_INTERVAL,
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            fencing_table: DEFAULT_FENCING_TABLE.to_owned(),
        }
    }
}

impl MysqlOptions {
    /// The ranges of the session budgets: a backend's sessions are server connections, of which
    /// MySQL allows 151 by default in all.
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
        MysqlOptions {
            connection_string: connection_string.into(),
            ..MysqlOptions::default()
        }
    }

    /// Sets [`connection_string`](Self::connection_string), the `mysql://` URL. Required;
    /// empty by default.
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
    /// to wait for keys held by other processes (0–1024). Default 8.
    pub fn with_max_wait_sessions(mut self, max_wait_sessions: usize) -> Self {
        self.max_wait_sessions = max_wait_sessions;
        self
    }

    /// Sets [`check_interval`](Self::check_interval), how often a held lock's session is
    /// checked. Default 5 s.
    pub fn with_check_interval(mut self, check_interval: Duration) -> Self {
        self.check_interval = check_interval;
        self
    }

    /// Sets [`query_timeout`](Self::query_timeout), the longest any one statement or
    /// connection attempt may take. Default 5 s.
    pub fn with_query_timeout(mut self, query_timeout: Duration) -> Self {
        self.query_timeout = query_timeout;
        self
    }

    /// Sets [`fencing_table`](Self::fencing_table), the table of the fencing-token counter.
    /// Default `lockingkit_fencing`.
    pub fn with_fencing_table(mut self, fencing_table: impl Into<String>) -> Self {
        self.fencing_table = fencing_table.into();
        self
    }

    /// Lists every problem with these options, each about one of their settings. An empty
    /// list means the options are valid. No problem quotes the connection string.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.connection_string.is_blank() {
            problems.push(Problem::new("connection_string", "is required"));
        } else if let Err(problem) = super::connection::parse(self.connection_string.expose()) {
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
        } else if self.query_timeout > MAX_QUERY_TIMEOUT {
            problems.push(Problem::new(
                "query_timeout",
                "must be at most 1 hour (it also bounds the server's wait for the fencing row)",
            ));
        }
        if !is_plain_identifier(&self.fencing_table) {
            problems.push(Problem::new(
                "fencing_table",
                "must be a lowercase SQL identifier of at most 60 characters (letters, digits, \
                 _; not starting with a digit)",
            ));
        }
        problems
    }
}

/// The longest statement timeout the options accept.
pub(super) const MAX_QUERY_TIMEOUT: Duration = Duration::from_secs(3600);

/// An identifier that needs no quoting in MySQL and means the same on every platform (table
/// names are case-sensitive on some file systems), so it can be spliced into SQL.
fn is_plain_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some('a'..='z' | '_'))
        && chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_'))
        && name.len() <= 60
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_need_only_a_connection_string() {
        assert_eq!(
            MysqlOptions::default().problems(),
            vec![Problem::new("connection_string", "is required")]
        );
        assert!(MysqlOptions::new("mysql://app@localhost/app")
            .problems()
            .is_empty());
    }

    #[test]
    fn every_problem_is_listed_without_the_secret() {
        let options = MysqlOptions {
            connection_string: "postgres://app:hunter2@db/app".into(),
            max_sessions: 0,
            max_wait_sessions: 2000,
            check_interval: Duration::ZERO,
            query_timeout: Duration::MAX,
            fencing_table: "Locks; DROP TABLE x".into(),
        };
        let problems = options.problems();
        assert_eq!(problems.len(), 6, "{problems:#?}");
        let shown: Vec<String> = problems
            .into_iter()
            .map(|p| p.at("Locking.Jobs").to_string())
            .collect();
        assert!(shown.iter().all(|p| p.starts_with("Locking.Jobs.")));
        assert!(shown.iter().all(|p| !p.contains("hunter2")), "{shown:#?}");
        assert!(!format!("{options:?}").contains("hunter2"));
    }

    #[test]
    fn each_setter_sets_the_setting_of_its_name() {
        let bound: MysqlOptions = serde_json::from_value(serde_json::json!({
            "connection_string": "mysql://app@db/app",
            "max_sessions": 2,
            "max_wait_sessions": 3,
            "check_interval": "4s",
            "query_timeout": "6s",
            "fencing_table": "tokens",
        }))
        .unwrap();
        let built = MysqlOptions::default()
            .with_connection_string("mysql://app@db/app")
            .with_max_sessions(2)
            .with_max_wait_sessions(3)
            .with_check_interval(Duration::from_secs(4))
            .with_query_timeout(Duration::from_secs(6))
            .with_fencing_table("tokens");
        assert_eq!(built, bound);
    }

    proptest::proptest! {
        /// Any durations and budgets, `Duration::MAX` included, are either refused with
        /// problems or build a backend: no arithmetic on them can overflow.
        #[test]
        fn any_durations_and_budgets_build_or_are_refused(
            check_ms in proptest::prop_oneof![proptest::num::u64::ANY, 0..10_000u64],
            query_ms in proptest::prop_oneof![proptest::num::u64::ANY, 0..10_000u64],
            sessions in proptest::prop_oneof![proptest::num::usize::ANY, 0..2_000usize],
            huge in proptest::bool::ANY,
        ) {
            let mut options = MysqlOptions::new("mysql://app@127.0.0.1/app")
                .with_check_interval(Duration::from_millis(check_ms))
                .with_query_timeout(Duration::from_millis(query_ms))
                .with_max_sessions(sessions)
                .with_max_wait_sessions(sessions);
            if huge {
                options = options
                    .with_check_interval(Duration::MAX)
                    .with_query_timeout(Duration::MAX);
            }
            let problems = options.problems();
            let built = super::super::MysqlBackend::open(options);
            proptest::prop_assert_eq!(problems.is_empty(), built.is_ok());
        }
    }

    #[test]
    fn identifiers_are_plain_lowercase_names() {
        assert!(is_plain_identifier("lockingkit_fencing"));
        assert!(!is_plain_identifier("2fencing"));
        assert!(!is_plain_identifier("Fencing"));
        assert!(!is_plain_identifier("a`b"));
        assert!(is_plain_identifier(&"a".repeat(60)));
        assert!(!is_plain_identifier(&"a".repeat(61)));
    }
}
