//! Options of the PostgreSQL provider.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::connection;
use crate::config::SecretString;

/// Options of the PostgreSQL provider, bindable from a `Locking.{name}` configuration section.
///
/// ```
/// use std::time::Duration;
/// use lockingkit::PostgresOptions;
///
/// let options = PostgresOptions {
///     pool_size: 32,
///     check_interval: Duration::from_secs(2),
///     ..PostgresOptions::new("postgres://app:secret@db.internal/app?sslmode=verify-full")
/// };
/// assert!(options.problems("Locking.Default").is_empty());
/// assert!(!format!("{options:?}").contains("secret"));
/// ```
///
/// Every held lock keeps one pooled connection for as long as it is held, so `pool_size` must
/// cover the locks this process holds at once plus a few for attempts in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PostgresOptions {
    /// A libpq connection string, as a URL (`postgres://user:pass@host:5432/db?sslmode=require`)
    /// or as `key=value` pairs. `sslmode` is one of `disable`, `prefer` (the default),
    /// `require`, `verify-ca` or `verify-full`, with libpq's meanings; `sslrootcert` names a PEM
    /// file whose certificates are the only trusted roots (without it, `verify-*` trusts the
    /// platform's store).
    pub connection_string: SecretString,
    /// The most connections the pool opens; each held lock keeps one.
    pub pool_size: usize,
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

/// The default pool size: a handful of held locks with room for attempts in flight.
pub const DEFAULT_POOL_SIZE: usize = 16;
/// The default connection check interval.
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(5);
/// The default statement timeout.
pub const DEFAULT_QUERY_TIMEOUT: Duration = Duration::from_secs(5);
/// The default schema of the fencing-token sequence.
pub const DEFAULT_FENCING_SCHEMA: &str = "lockingkit";
/// The default name of the fencing-token sequence.
pub const DEFAULT_FENCING_SEQUENCE: &str = "fencing_tokens";

impl Default for PostgresOptions {
    fn default() -> Self {
        PostgresOptions {
            connection_string: SecretString::default(),
            pool_size: DEFAULT_POOL_SIZE,
            check_interval: DEFAULT_CHECK_INTERVAL,
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            fencing_schema: DEFAULT_FENCING_SCHEMA.to_owned(),
            fencing_sequence: DEFAULT_FENCING_SEQUENCE.to_owned(),
        }
    }
}

impl PostgresOptions {
    /// Default options for `connection_string`.
    pub fn new(connection_string: impl Into<SecretString>) -> Self {
        PostgresOptions {
            connection_string: connection_string.into(),
            ..PostgresOptions::default()
        }
    }

    /// Lists every problem with these options, prefixed with `section` (such as
    /// `Locking.Default`). An empty list means the options are valid. No message quotes the
    /// connection string.
    pub fn problems(&self, section: &str) -> Vec<String> {
        let mut problems = Vec::new();
        if self.connection_string.is_blank() {
            problems.push(format!("{section}.connection_string is required"));
        } else if let Err(problem) = connection::parse(self.connection_string.expose()) {
            problems.push(format!("{section}.connection_string: {problem}"));
        }
        if self.pool_size == 0 {
            problems.push(format!("{section}.pool_size must be at least 1"));
        }
        if self.check_interval.is_zero() {
            problems.push(format!(
                "{section}.check_interval must be greater than zero"
            ));
        }
        if self.query_timeout.is_zero() {
            problems.push(format!("{section}.query_timeout must be greater than zero"));
        }
        for (field, value) in [
            ("fencing_schema", &self.fencing_schema),
            ("fencing_sequence", &self.fencing_sequence),
        ] {
            if !is_plain_identifier(value) {
                problems.push(format!(
                    "{section}.{field} must be a lowercase SQL identifier of at most 63 characters (letters, digits, _; not starting with a digit)"
                ));
            }
        }
        problems
    }
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
            PostgresOptions::default().problems("Locking.Default"),
            vec!["Locking.Default.connection_string is required".to_owned()]
        );
        assert!(PostgresOptions::new("host=localhost user=app")
            .problems("Locking.Default")
            .is_empty());
    }

    #[test]
    fn every_problem_is_listed_without_the_secret() {
        let options = PostgresOptions {
            connection_string: "postgres://app:hunter2@db/app?sslmode=hunter2".into(),
            pool_size: 0,
            check_interval: Duration::ZERO,
            query_timeout: Duration::ZERO,
            fencing_schema: "Locks; DROP TABLE x".into(),
            fencing_sequence: String::new(),
        };
        let problems = options.problems("Locking.Jobs");
        assert_eq!(problems.len(), 6, "{problems:#?}");
        assert!(problems.iter().all(|p| p.starts_with("Locking.Jobs.")));
        assert!(problems.iter().all(|p| !p.contains("hunter2")));
        assert!(!format!("{options:?}").contains("hunter2"));
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
