//! Options of the Redis provider, bound from configuration and checked at startup.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::connection::Target;
use super::keys::RedisLockKeys;
use crate::config::{timeout_beyond_a_third_of_lease, Problem, SecretString, WholeNumbers};

/// The shortest lease: a renewal every third of it must still fit a round trip.
pub const MIN_LEASE_DURATION: Duration = Duration::from_millis(300);
/// The longest lease: a crashed holder keeps a key for up to this long, so an hour is plenty.
pub const MAX_LEASE_DURATION: Duration = Duration::from_secs(3600);
/// The longest prefix, in bytes: it is repeated in every key name.
pub const MAX_KEY_PREFIX_LEN: usize = 128;

/// Options of [`RedisBackend`](super::RedisBackend), bindable from a `Locking.{name}`
/// configuration section (`provider = "redis"`).
///
/// Every field has a default except `url`. The defaults bound every call: a request that gets
/// no answer in `request_timeout` (2 s) fails, so a frozen server costs a waiter seconds, and
/// a lease of 30 s is renewed every 10 s (the engine's
/// [`renew_every`](crate::LockOptions::renew_every)), a failed renewal being retried until the
/// loss deadline at 27 s.
///
/// ```
/// use std::time::Duration;
/// use lockingkit::RedisOptions;
///
/// let options = RedisOptions::new("redis://app:secret@cache.internal:6379/0")
///     .with_lease_duration(Duration::from_secs(15));
/// assert!(options.problems().is_empty());
/// assert!(!format!("{options:?}").contains("secret"));
/// ```
///
/// Build them with [`RedisOptions::new`] or [`RedisOptions::cluster`] and the `with_*` setters;
/// the struct is `#[non_exhaustive]`, so a later release can add a setting without breaking you.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RedisOptions {
    /// The server: `redis://[user[:password]@]host[:port][/db]`, `rediss://…` for TLS (one
    /// server only; see `tls_root_cert`), or `unix:///path?db=0&pass=…`. With `cluster`, one or
    /// more nodes of the cluster separated by commas (the others are discovered). Secret: it
    /// may carry the password.
    pub url: SecretString,
    /// Whether `url` names nodes of a Redis Cluster (database 0 only).
    pub cluster: bool,
    /// The start of every key name (see [`RedisLockKeys`]); default `lockingkit`. Processes
    /// that share locks must share the prefix.
    pub key_prefix: String,
    /// How long a lease lasts unless renewed: 300 ms to 1 h, whole milliseconds. Default 30 s.
    #[serde(with = "crate::config::duration")]
    pub lease_duration: Duration,
    /// The longest one request (or connection attempt) may take. Default 2 s; at most a third
    /// of the lease, so a failed renewal can be retried before the loss deadline.
    #[serde(with = "crate::config::duration")]
    pub request_timeout: Duration,
    /// How many replicas must acknowledge an acquire or a renewal (`WAIT`) before it counts;
    /// default 0 (no waiting), at most 64. An acquire that fewer replicas acknowledge within
    /// `replica_timeout` is given back and reported unavailable. This narrows, but does not
    /// close, the window in which a failover loses a lock: see the Redis guide. `WAIT` holds up
    /// the backend's one connection until it is answered, so a backend then makes about one
    /// acquire or renewal per replication round trip (the guide has numbers).
    pub replicas: u32,
    /// How long an acquire or renewal waits for `replicas` acknowledgements. Default 500 ms;
    /// shorter than `request_timeout`.
    #[serde(with = "crate::config::duration")]
    pub replica_timeout: Duration,
    /// For a `rediss://` URL (TLS), a PEM file of the certificate authorities to trust instead
    /// of the platform's trust store (a private CA, say). Unset by default: the platform's
    /// store checks the server's certificate, and its name must match the URL's host either way.
    pub tls_root_cert: Option<PathBuf>,
    /// How long a writer that found the key read holds new readers back after each of its
    /// attempts (its *intent*). Default 2 s; it must be longer than the engine's
    /// `max_retry_delay` (1 s by default), so the intent stands for as long as the writer waits:
    /// the registry refuses a provider whose settings break that rule; with
    /// [`DistributedLock::builder`](crate::DistributedLock::builder), keep to it yourself.
    #[serde(with = "crate::config::duration")]
    pub writer_intent: Duration,
}

/// The default lease.
pub(super) const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// The default per-request timeout.
pub(super) const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            url: SecretString::default(),
            cluster: false,
            key_prefix: RedisLockKeys::DEFAULT_PREFIX.to_owned(),
            lease_duration: DEFAULT_LEASE,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            replicas: 0,
            replica_timeout: Duration::from_millis(500),
            writer_intent: Duration::from_secs(2),
            tls_root_cert: None,
        }
    }
}

/// The most replicas `replicas` may ask for: `WAIT` blocks the shared connection for up to
/// `replica_timeout` whenever fewer acknowledge, so asking for more than a primary could have
/// is a mistake.
pub(super) const MAX_REPLICAS: u32 = 64;

impl RedisOptions {
    /// The range of `replicas`.
    pub(crate) const WHOLE_NUMBERS: &'static [WholeNumbers] = &[WholeNumbers {
        setting: "replicas",
        min: 0,
        max: MAX_REPLICAS as u64,
    }];

    /// Default options for the server at `url`.
    pub fn new(url: impl Into<SecretString>) -> Self {
        RedisOptions {
            url: url.into(),
            ..RedisOptions::default()
        }
    }

    /// Default options for the Redis Cluster reached through `nodes` (one is enough).
    pub fn cluster<I, S>(nodes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let nodes: Vec<String> = nodes.into_iter().map(|n| n.as_ref().to_owned()).collect();
        RedisOptions {
            url: nodes.join(",").into(),
            cluster: true,
            ..RedisOptions::default()
        }
    }

    /// Sets [`url`](Self::url), the server (or with `cluster`, nodes of the cluster). Required;
    /// empty by default.
    pub fn with_url(mut self, url: impl Into<SecretString>) -> Self {
        self.url = url.into();
        self
    }

    /// Sets [`cluster`](Self::cluster), whether `url` names nodes of a Redis Cluster. Default
    /// `false`.
    pub fn with_cluster(mut self, cluster: bool) -> Self {
        self.cluster = cluster;
        self
    }

    /// Sets [`key_prefix`](Self::key_prefix), the start of every key name (1–128 bytes).
    /// Default `lockingkit`.
    pub fn with_key_prefix(mut self, key_prefix: impl Into<String>) -> Self {
        self.key_prefix = key_prefix.into();
        self
    }

    /// Sets [`lease_duration`](Self::lease_duration), how long a lease lasts unless renewed
    /// (300 ms to 1 h, whole milliseconds). Default 30 s.
    pub fn with_lease_duration(mut self, lease_duration: Duration) -> Self {
        self.lease_duration = lease_duration;
        self
    }

    /// Sets [`request_timeout`](Self::request_timeout), the longest one request (or connection
    /// attempt) may take. Default 2 s.
    pub fn with_request_timeout(mut self, request_timeout: Duration) -> Self {
        self.request_timeout = request_timeout;
        self
    }

    /// Sets [`replicas`](Self::replicas), how many replicas must acknowledge an acquire or a
    /// renewal (0–64). Default 0.
    pub fn with_replicas(mut self, replicas: u32) -> Self {
        self.replicas = replicas;
        self
    }

    /// Sets [`replica_timeout`](Self::replica_timeout), how long an acquire or renewal waits
    /// for the replicas' acknowledgements. Default 500 ms.
    pub fn with_replica_timeout(mut self, replica_timeout: Duration) -> Self {
        self.replica_timeout = replica_timeout;
        self
    }

    /// Sets [`tls_root_cert`](Self::tls_root_cert), a PEM file of the certificate authorities
    /// to trust for a `rediss://` URL. Unset by default (the platform's trust store).
    pub fn with_tls_root_cert(mut self, tls_root_cert: impl Into<PathBuf>) -> Self {
        self.tls_root_cert = Some(tls_root_cert.into());
        self
    }

    /// Sets [`writer_intent`](Self::writer_intent), how long a writer that found the key read
    /// holds new readers back after each attempt; longer than the engine's `max_retry_delay`.
    /// Default 2 s.
    pub fn with_writer_intent(mut self, writer_intent: Duration) -> Self {
        self.writer_intent = writer_intent;
        self
    }

    /// Every problem with these options, each about the setting it names (place them in a
    /// section with [`Problem::at`]). An empty list means the options are valid. No message
    /// quotes the URL.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems: Vec<Problem> = Target::problems(self)
            .into_iter()
            .map(|problem| Problem::new("url", problem))
            .collect();
        if self.tls_root_cert.is_some() && !Target::uses_tls(self) {
            problems.push(
                Problem::new(
                    "tls_root_cert",
                    "is set, but url does not use TLS (rediss://)",
                )
                .involving("url"),
            );
        }
        if self.key_prefix.is_empty() || self.key_prefix.len() > MAX_KEY_PREFIX_LEN {
            problems.push(Problem::new(
                "key_prefix",
                format!("must be 1 to {MAX_KEY_PREFIX_LEN} bytes"),
            ));
        }
        problems.extend(self.duration_problems());
        for range in Self::WHOLE_NUMBERS {
            problems.extend(range.check(u64::from(self.replicas)));
        }
        problems
    }

    /// The problems of the durations, alone and against each other.
    fn duration_problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        let lease = self.lease_duration;
        if !(MIN_LEASE_DURATION..=MAX_LEASE_DURATION).contains(&lease) {
            problems.push(Problem::new(
                "lease_duration",
                format!("must be between 300ms and 1h (was {lease:?})"),
            ));
        } else if !lease.subsec_nanos().is_multiple_of(1_000_000) {
            problems.push(Problem::new(
                "lease_duration",
                format!("must be whole milliseconds (was {lease:?})"),
            ));
        }
        let timeout = self.request_timeout;
        if timeout.is_zero() {
            problems.push(Problem::new("request_timeout", "must be greater than zero"));
        } else {
            problems.extend(timeout_beyond_a_third_of_lease(
                "request_timeout",
                timeout,
                "lease_duration",
                lease,
            ));
        }
        if self.replicas > 0
            && (self.replica_timeout < Duration::from_millis(1) || self.replica_timeout >= timeout)
        {
            problems.push(
                Problem::new(
                    "replica_timeout",
                    "must be at least 1ms and shorter than {request_timeout}",
                )
                .involving("request_timeout")
                .involving("replicas")
                .showing("replica_timeout", format!("{:?}", self.replica_timeout))
                .showing("request_timeout", format!("{timeout:?}")),
            );
        }
        if self.writer_intent < Duration::from_millis(1) || self.writer_intent > lease {
            problems.push(
                Problem::new(
                    "writer_intent",
                    "must be at least 1ms and at most {lease_duration}",
                )
                .involving("lease_duration")
                .showing("writer_intent", format!("{:?}", self.writer_intent))
                .showing("lease_duration", format!("{lease:?}")),
            );
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_need_only_a_url() {
        let problems = RedisOptions::default().problems();
        assert_eq!(problems, vec![Problem::new("url", "is required")]);
        assert_eq!(
            problems[0].clone().at("Locking.Default").to_string(),
            "Locking.Default.url is required"
        );
        let options = RedisOptions::new("redis://127.0.0.1:6379");
        assert!(options.problems().is_empty());
        assert_eq!(options.lease_duration, Duration::from_secs(30));
        assert_eq!(options.key_prefix, "lockingkit");
        assert!(RedisOptions::cluster(["redis://a:7000", "redis://b:7001"])
            .problems()
            .is_empty());
        assert!(RedisOptions::new("unix:///run/redis.sock?db=2")
            .problems()
            .is_empty());
        assert!(RedisOptions::new("rediss://:secret@cache.internal:6380/0")
            .problems()
            .is_empty());
    }

    #[test]
    fn each_setter_sets_the_setting_of_its_name() {
        let bound: RedisOptions = serde_json::from_value(serde_json::json!({
            "url": "rediss://cache:6380",
            "cluster": true,
            "key_prefix": "locks",
            "lease_duration": "10s",
            "request_timeout": "1s",
            "replicas": 2,
            "replica_timeout": "300ms",
            "tls_root_cert": "/etc/ca.pem",
            "writer_intent": "4s",
        }))
        .unwrap();
        let built = RedisOptions::default()
            .with_url("rediss://cache:6380")
            .with_cluster(true)
            .with_key_prefix("locks")
            .with_lease_duration(Duration::from_secs(10))
            .with_request_timeout(Duration::from_secs(1))
            .with_replicas(2)
            .with_replica_timeout(Duration::from_millis(300))
            .with_tls_root_cert("/etc/ca.pem")
            .with_writer_intent(Duration::from_secs(4));
        assert_eq!(built, bound);
    }

    #[test]
    fn every_problem_is_listed_without_the_secret() {
        let options = RedisOptions {
            url: "http://app:hunter2@cache/0".into(),
            cluster: false,
            key_prefix: String::new(),
            lease_duration: Duration::from_millis(100),
            request_timeout: Duration::ZERO,
            replicas: 1,
            replica_timeout: Duration::ZERO,
            writer_intent: Duration::ZERO,
            tls_root_cert: Some("/etc/ssl/private-ca.pem".into()),
        };
        let problems = options.problems();
        assert_eq!(problems.len(), 7, "{problems:#?}");
        let settings: Vec<&str> = problems.iter().map(Problem::setting).collect();
        assert_eq!(
            settings,
            [
                "url",
                "tls_root_cert",
                "key_prefix",
                "lease_duration",
                "request_timeout",
                "replica_timeout",
                "writer_intent",
            ]
        );
        let placed: Vec<String> = problems
            .into_iter()
            .map(|p| p.at("Locking.Jobs").to_string())
            .collect();
        assert!(placed.iter().all(|p| p.starts_with("Locking.Jobs.")));
        assert!(placed.iter().all(|p| !p.contains("hunter2")), "{placed:#?}");
        assert!(!format!("{options:?}").contains("hunter2"));
    }

    #[test]
    fn urls_that_cannot_lock_are_refused() {
        for (url, cluster, expected) in [
            ("cache.internal:6379", false, "redis://"),
            ("redis://a:1,redis://b:2", false, "one server"),
            (
                "rediss://cache:6380,rediss://other:6380",
                true,
                "one server only",
            ),
            (
                "rediss://:hunter2@cache:6380/#insecure",
                false,
                "tls_root_cert",
            ),
            ("redis://cache/1", true, "other than 0"),
            ("redis://:hunter2@", false, "redis://"),
        ] {
            let options = RedisOptions {
                cluster,
                ..RedisOptions::new(url)
            };
            let problems: Vec<String> = options.problems().iter().map(|p| p.to_string()).collect();
            let problems = problems.join("\n");
            assert!(problems.contains(expected), "{url}: {problems}");
            assert!(!problems.contains("hunter2"), "{problems}");
        }
    }

    #[test]
    fn a_request_timeout_longer_than_a_third_of_the_lease_is_refused() {
        let options = RedisOptions {
            lease_duration: Duration::from_secs(3),
            request_timeout: Duration::from_millis(1001),
            ..RedisOptions::new("redis://127.0.0.1")
        };
        assert_eq!(options.problems()[0].setting(), "request_timeout");
        let fractional = RedisOptions {
            lease_duration: Duration::from_micros(30_000_500),
            ..RedisOptions::new("redis://127.0.0.1")
        };
        assert!(fractional.problems()[0]
            .to_string()
            .contains("whole milliseconds"));
    }

    #[test]
    fn options_bind_from_configuration_and_refuse_unknown_fields() {
        let options: RedisOptions = serde_json::from_str(
            r#"{"url":"redis://127.0.0.1:6379","lease_duration":"20s","request_timeout":"1s",
                "replicas":1,"replica_timeout":"250ms","key_prefix":"jobs"}"#,
        )
        .unwrap();
        assert_eq!(options.lease_duration, Duration::from_secs(20));
        assert_eq!(options.replica_timeout, Duration::from_millis(250));
        assert_eq!(options.key_prefix, "jobs");
        assert!(options.problems().is_empty());
        assert!(serde_json::from_str::<RedisOptions>(r#"{"lease":"20s"}"#).is_err());
    }
}
