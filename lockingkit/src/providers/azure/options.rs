//! Options of the Azure Blob lease provider, bound from configuration and checked at startup.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{timeout_beyond_a_third_of_lease, Problem, SecretString, WholeNumbers};

use super::client::connection_string::ConnectionString;

/// The shortest lease Azure grants.
pub const MIN_LEASE_DURATION: Duration = Duration::from_secs(15);
/// The longest finite lease Azure grants; infinite leases are refused on purpose.
pub const MAX_LEASE_DURATION: Duration = Duration::from_secs(60);
/// The most retries a request may be given: more only delays the answer a waiter needs.
pub const MAX_RETRIES_LIMIT: u32 = 10;

/// Options of [`AzureBlobBackend`](super::AzureBlobBackend).
///
/// Bind them from a `Locking.{name}` configuration section; every field has a default except
/// the account: set `connection_string`, or `service_url` together with a token credential
/// passed to [`AzureBlobBackend::with_credential`](super::AzureBlobBackend::with_credential).
///
/// The defaults bound every call: a request that gets no answer in `request_timeout` (5 s)
/// fails, including its retries, so a hung storage endpoint costs a waiter seconds rather than
/// the two minutes the SDK's own defaults allow. How often leases are renewed is an engine
/// option ([`LockOptions::renew_every`](crate::LockOptions::renew_every), a third of the lease
/// by default).
///
/// ```
/// let options: lockingkit::providers::azure::AzureBlobOptions = serde_json::from_str(r#"{
///     "connection_string": "UseDevelopmentStorage=true",
///     "container": "locks",
///     "lease_duration": "30s"
/// }"#).unwrap();
/// assert!(options.problems().is_empty());
/// ```
///
/// In code, start from [`from_connection_string`](Self::from_connection_string) or
/// [`from_service_url`](Self::from_service_url) and change the rest with the `with_*` setters;
/// the struct is `#[non_exhaustive]`, so a later release can add a setting without breaking you.
///
/// ```
/// use std::time::Duration;
/// use lockingkit::AzureBlobOptions;
///
/// let options = AzureBlobOptions::from_connection_string("UseDevelopmentStorage=true")
///     .with_container("job-locks")
///     .with_lease_duration(Duration::from_secs(20));
/// assert!(options.problems().is_empty());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct AzureBlobOptions {
    /// A storage connection string: `AccountName`/`AccountKey` (with `DefaultEndpointsProtocol`
    /// and `EndpointSuffix`, or `BlobEndpoint`), `BlobEndpoint` with `SharedAccessSignature`, or
    /// `UseDevelopmentStorage=true` for a local Azurite.
    pub connection_string: Option<SecretString>,
    /// The blob service URL (`https://{account}.blob.core.windows.net`) for Microsoft Entra
    /// authentication with a token credential.
    pub service_url: Option<String>,
    /// The container holding the guard blobs; it must exist. Default `locks`.
    pub container: String,
    /// How long a lease lasts unless renewed: 15 to 60 s, whole seconds. Default 30 s.
    #[serde(with = "crate::config::duration")]
    pub lease_duration: Duration,
    /// The longest one backend call may take, retries included. Default 5 s; at most a third
    /// of the lease, so a failed renewal can be retried before the loss deadline.
    #[serde(with = "crate::config::duration")]
    pub request_timeout: Duration,
    /// How often a request that failed in a retryable way (connection reset, 408, 429, 5xx) is
    /// sent again within `request_timeout`. Default 2.
    pub max_retries: u32,
    /// The first delay before a retry, doubling after each. Default 100 ms.
    #[serde(with = "crate::config::duration")]
    pub retry_delay: Duration,
}

impl Default for AzureBlobOptions {
    fn default() -> Self {
        AzureBlobOptions {
            connection_string: None,
            service_url: None,
            container: "locks".to_owned(),
            lease_duration: Duration::from_secs(30),
            request_timeout: Duration::from_secs(5),
            max_retries: 2,
            retry_delay: Duration::from_millis(100),
        }
    }
}

impl AzureBlobOptions {
    /// The range of `max_retries`.
    pub(crate) const WHOLE_NUMBERS: &'static [WholeNumbers] = &[WholeNumbers {
        setting: "max_retries",
        min: 0,
        max: MAX_RETRIES_LIMIT as u64,
    }];

    /// Options for the account in `connection_string`, with every other field at its default.
    pub fn from_connection_string(connection_string: impl Into<SecretString>) -> Self {
        AzureBlobOptions {
            connection_string: Some(connection_string.into()),
            ..Self::default()
        }
    }

    /// Options for the blob service at `service_url` (Entra authentication), with every other
    /// field at its default.
    pub fn from_service_url(service_url: impl Into<String>) -> Self {
        AzureBlobOptions {
            service_url: Some(service_url.into()),
            ..Self::default()
        }
    }

    /// Sets [`connection_string`](Self::connection_string), the storage account's connection
    /// string. Unset by default.
    pub fn with_connection_string(mut self, connection_string: impl Into<SecretString>) -> Self {
        self.connection_string = Some(connection_string.into());
        self
    }

    /// Sets [`service_url`](Self::service_url), the blob service URL for Entra authentication.
    /// Unset by default.
    pub fn with_service_url(mut self, service_url: impl Into<String>) -> Self {
        self.service_url = Some(service_url.into());
        self
    }

    /// Sets [`container`](Self::container), the container holding the guard blobs. Default
    /// `locks`.
    pub fn with_container(mut self, container: impl Into<String>) -> Self {
        self.container = container.into();
        self
    }

    /// Sets [`lease_duration`](Self::lease_duration), how long a lease lasts unless renewed
    /// (15 to 60 s, whole seconds). Default 30 s.
    pub fn with_lease_duration(mut self, lease_duration: Duration) -> Self {
        self.lease_duration = lease_duration;
        self
    }

    /// Sets [`request_timeout`](Self::request_timeout), the longest one backend call may take,
    /// retries included. Default 5 s.
    pub fn with_request_timeout(mut self, request_timeout: Duration) -> Self {
        self.request_timeout = request_timeout;
        self
    }

    /// Sets [`max_retries`](Self::max_retries), how often a retryable failure is sent again
    /// within the timeout. Default 2.
    pub fn with_max_retries(mut self, max_retries: u32) -> Self {
        self.max_retries = max_retries;
        self
    }

    /// Sets [`retry_delay`](Self::retry_delay), the first delay before a retry. Default
    /// 100 ms.
    pub fn with_retry_delay(mut self, retry_delay: Duration) -> Self {
        self.retry_delay = retry_delay;
        self
    }

    /// Lists every problem with these options, each about one of their settings (or the
    /// options as a whole). An empty list means the options are valid. Secrets are never
    /// repeated in the messages.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        match (&self.connection_string, &self.service_url) {
            (None, None) => problems.push(Problem::of_section(
                "set connection_string, or service_url with a token credential",
            )),
            (Some(_), Some(_)) => problems.push(Problem::of_section(
                "set either connection_string or service_url, not both",
            )),
            (Some(connection_string), None) => {
                if let Err(errors) = ConnectionString::parse(connection_string.expose()) {
                    problems.extend(
                        errors
                            .into_iter()
                            .map(|e| Problem::detail("connection_string", e)),
                    );
                }
            }
            (None, Some(url)) => {
                if let Err(problem) = super::client::parse_service_url(url) {
                    problems.push(Problem::detail("service_url", problem));
                }
            }
        }
        if let Err(problem) = check_container_name(&self.container) {
            problems.push(Problem::detail("container", problem));
        }
        let lease = self.lease_duration;
        if lease < MIN_LEASE_DURATION || lease > MAX_LEASE_DURATION {
            problems.push(Problem::new(
                "lease_duration",
                format!(
                    "must be between 15s and 60s (was {lease:?}); infinite leases are not \
                     supported"
                ),
            ));
        } else if lease.subsec_nanos() != 0 {
            problems.push(Problem::new(
                "lease_duration",
                format!("must be whole seconds (was {lease:?})"),
            ));
        }
        if self.request_timeout.is_zero() {
            problems.push(Problem::new("request_timeout", "must be greater than zero"));
        } else {
            problems.extend(timeout_beyond_a_third_of_lease(
                "request_timeout",
                self.request_timeout,
                "lease_duration",
                lease,
            ));
        }
        for range in Self::WHOLE_NUMBERS {
            problems.extend(range.check(u64::from(self.max_retries)));
        }
        if self.retry_delay.is_zero() || self.retry_delay > self.request_timeout {
            problems.push(
                Problem::new(
                    "retry_delay",
                    "must be greater than zero and at most {request_timeout}",
                )
                .involving("request_timeout")
                .showing("retry_delay", format!("{:?}", self.retry_delay))
                .showing("request_timeout", format!("{:?}", self.request_timeout)),
            );
        }
        problems
    }
}

/// Azure's container naming rules: 3–63 lowercase letters, digits and single hyphens, starting
/// and ending with a letter or digit (or the special `$root`).
fn check_container_name(name: &str) -> Result<(), String> {
    if name == "$root" {
        return Ok(());
    }
    let valid_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !(3..=63).contains(&name.len())
        || !valid_chars
        || name.starts_with('-')
        || name.ends_with('-')
        || name.contains("--")
    {
        return Err(format!(
            "`{name}` is not a valid container name (3-63 lowercase letters, digits and single \
             hyphens, starting and ending with a letter or digit)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The problems as the registry shows them for a section.
    trait Shown {
        fn shown(&self, section: &str) -> Vec<String>;
    }

    impl Shown for AzureBlobOptions {
        fn shown(&self, section: &str) -> Vec<String> {
            let problems = self.problems().into_iter();
            problems.map(|p| p.at(section).to_string()).collect()
        }
    }

    fn valid() -> AzureBlobOptions {
        AzureBlobOptions::from_connection_string("UseDevelopmentStorage=true")
    }

    #[test]
    fn defaults_with_an_account_are_valid() {
        assert_eq!(valid().shown("Locking.Default"), Vec::<String>::new());
        assert_eq!(valid().container, "locks");
        assert_eq!(valid().lease_duration, Duration::from_secs(30));
    }

    #[test]
    fn leases_outside_15_to_60_seconds_are_refused() {
        for secs in [0, 14, 61, 3600] {
            let problems = valid()
                .with_lease_duration(Duration::from_secs(secs))
                .shown("S");
            assert!(
                problems.iter().any(|p| p.starts_with("S.lease_duration")),
                "{secs}s: {problems:?}"
            );
        }
        for secs in [15, 60] {
            let options = valid()
                .with_lease_duration(Duration::from_secs(secs))
                .with_request_timeout(Duration::from_secs(5));
            assert!(options.shown("S").is_empty(), "{secs}s");
        }
    }

    #[test]
    fn fractional_leases_are_refused() {
        let problems = valid()
            .with_lease_duration(Duration::from_millis(20_500))
            .shown("S");
        assert!(problems.iter().any(|p| p.contains("whole seconds")));
    }

    #[test]
    fn every_problem_is_listed_at_once() {
        let options = AzureBlobOptions {
            connection_string: None,
            service_url: None,
            container: "Bad_Name".into(),
            lease_duration: Duration::from_secs(90),
            request_timeout: Duration::ZERO,
            max_retries: 99,
            retry_delay: Duration::ZERO,
        };
        let problems = options.shown("Locking.Jobs");
        assert_eq!(problems.len(), 6, "{problems:?}");
        assert!(problems.iter().all(|p| p.starts_with("Locking.Jobs")));
    }

    #[test]
    fn a_request_timeout_longer_than_a_third_of_the_lease_is_refused() {
        let problems = valid()
            .with_lease_duration(Duration::from_secs(15))
            .with_request_timeout(Duration::from_secs(6))
            .shown("S");
        assert!(problems.iter().any(|p| p.starts_with("S.request_timeout")));
    }

    #[test]
    fn container_names_follow_azure_rules() {
        for good in ["locks", "abc", "a-b-c", "0locks", "$root", &"a".repeat(63)] {
            assert!(check_container_name(good).is_ok(), "{good}");
        }
        for bad in [
            "ab",
            "Locks",
            "a--b",
            "-ab",
            "ab-",
            "a_b",
            "a.b",
            &"a".repeat(64),
        ] {
            assert!(check_container_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn both_or_neither_account_settings_are_refused() {
        let mut both = valid();
        both.service_url = Some("https://acct.blob.core.windows.net".into());
        assert!(both.shown("S")[0].contains("not both"));
        let neither = AzureBlobOptions::default();
        assert!(neither.shown("S")[0].contains("connection_string"));
    }

    #[test]
    fn problems_never_repeat_the_connection_string() {
        let options = AzureBlobOptions::from_connection_string(
            "AccountName=acct;AccountKey=not base64 hunter2;Bogus=1",
        );
        let problems = options.shown("S").join("\n");
        assert!(!problems.contains("hunter2"), "{problems}");
        assert!(problems.contains("AccountKey"), "{problems}");
        assert!(!format!("{options:?}").contains("hunter2"));
    }

    #[test]
    fn each_setter_sets_the_setting_of_its_name() {
        let bound: AzureBlobOptions = serde_json::from_value(serde_json::json!({
            "connection_string": "UseDevelopmentStorage=true",
            "service_url": "https://acct.blob.core.windows.net",
            "container": "job-locks",
            "lease_duration": "20s",
            "request_timeout": "2s",
            "max_retries": 3,
            "retry_delay": "50ms",
        }))
        .unwrap();
        let built = AzureBlobOptions::default()
            .with_connection_string("UseDevelopmentStorage=true")
            .with_service_url("https://acct.blob.core.windows.net")
            .with_container("job-locks")
            .with_lease_duration(Duration::from_secs(20))
            .with_request_timeout(Duration::from_secs(2))
            .with_max_retries(3)
            .with_retry_delay(Duration::from_millis(50));
        assert_eq!(built, bound);
    }

    #[test]
    fn options_bind_from_configuration_and_refuse_unknown_fields() {
        let options: AzureBlobOptions = serde_json::from_str(
            r#"{"connection_string":"UseDevelopmentStorage=true","lease_duration":"20s",
                "request_timeout":"2s","max_retries":1,"retry_delay":"50ms"}"#,
        )
        .unwrap();
        assert_eq!(options.lease_duration, Duration::from_secs(20));
        assert_eq!(options.request_timeout, Duration::from_secs(2));
        assert_eq!(options.container, "locks");
        assert!(serde_json::from_str::<AzureBlobOptions>(r#"{"lease":"20s"}"#).is_err());
    }
}
