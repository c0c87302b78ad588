//! Options of the etcd provider, bound from configuration and checked at startup.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{timeout_beyond_a_third_of_lease, Problem, SecretString};

/// The shortest lease accepted. etcd itself raises a shorter TTL to one and a half election
/// timeouts (1.5 s with the default election timeout), and the engine renews every third.
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(2);
/// The longest lease accepted: a lease that outlives its process this long blocks its keys.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(3600);
/// The default key prefix: every key the provider writes starts with it.
pub const DEFAULT_KEY_PREFIX: &str = "lockingkit/";

/// Options of [`EtcdBackend`](super::EtcdBackend), bindable from a `Locking.{name}` section.
///
/// ```
/// use std::time::Duration;
/// use lockingkit::EtcdOptions;
///
/// let options = EtcdOptions::new(["http://10.0.0.1:2379", "http://10.0.0.2:2379"])
///     .with_user("locks")
///     .with_password("hunter2")
///     .with_lease_ttl(Duration::from_secs(15));
/// assert!(options.problems().is_empty());
/// assert!(!format!("{options:?}").contains("hunter2"));
/// ```
///
/// Every request has a timeout (`request_timeout`); holds share one etcd lease per backend,
/// kept alive by the engine's renewal (see the etcd guide for the connection budget).
///
/// Build them with [`EtcdOptions::new`] and the `with_*` setters; the struct is
/// `#[non_exhaustive]`, so a later release can add a setting without breaking you.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct EtcdOptions {
    /// The cluster's client URLs: `http://host:2379`, or `https://…` for TLS. Each is a member
    /// with a client of its own; requests go to the last one that answered, and a member that
    /// fails is left alone for a backoff while the others serve.
    pub endpoints: Vec<String>,
    /// The etcd user, when the cluster has authentication enabled; needs `password`.
    pub user: Option<String>,
    /// The password of `user`.
    pub password: Option<SecretString>,
    /// A PEM file of the certificate authorities trusted for `https` endpoints. Without it the
    /// platform's trust store is used.
    pub tls_ca_file: Option<PathBuf>,
    /// A PEM client certificate for mutual TLS; needs `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// The PEM private key of `tls_cert_file`.
    pub tls_key_file: Option<PathBuf>,
    /// The name the servers' certificates are checked against, when it is not the endpoint's
    /// host.
    pub tls_domain: Option<String>,
    /// Where the provider's keys live: every key it writes starts with this. Default
    /// `lockingkit/`. Two applications with different prefixes never exclude each other.
    pub key_prefix: String,
    /// The TTL of the backend's etcd lease, which every hold and queue place is attached to:
    /// a process that vanishes frees its keys this long after its last renewal. Whole seconds,
    /// 2 s to 1 h. Default 30 s.
    #[serde(with = "crate::config::duration")]
    pub lease_ttl: Duration,
    /// The longest any one request (or connection attempt) may take, resends to other members
    /// included. Default 5 s; at most a third of `lease_ttl`, so a failed renewal can be
    /// retried before the loss deadline.
    #[serde(with = "crate::config::duration")]
    pub request_timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        EtcdOptions {
            endpoints: Vec::new(),
            user: None,
            password: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_domain: None,
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            lease_ttl: Duration::from_secs(30),
            request_timeout: Duration::from_secs(5),
        }
    }
}

impl EtcdOptions {
    /// Default options for a cluster reached at `endpoints`.
    pub fn new<E: Into<String>>(endpoints: impl IntoIterator<Item = E>) -> Self {
        EtcdOptions {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            ..EtcdOptions::default()
        }
    }

    /// Sets [`endpoints`](Self::endpoints), the cluster's client URLs. Required; none by
    /// default.
    pub fn with_endpoints<E: Into<String>>(
        mut self,
        endpoints: impl IntoIterator<Item = E>,
    ) -> Self {
        self.endpoints = endpoints.into_iter().map(Into::into).collect();
        self
    }

    /// Sets [`user`](Self::user), the etcd user when the cluster has authentication enabled;
    /// needs a password. Unset by default.
    pub fn with_user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    /// Sets [`password`](Self::password), the password of `user`. Unset by default.
    pub fn with_password(mut self, password: impl Into<SecretString>) -> Self {
        self.password = Some(password.into());
        self
    }

    /// Sets [`tls_ca_file`](Self::tls_ca_file), a PEM file of the certificate authorities
    /// trusted for `https` endpoints. Unset by default (the platform's trust store).
    pub fn with_tls_ca_file(mut self, tls_ca_file: impl Into<PathBuf>) -> Self {
        self.tls_ca_file = Some(tls_ca_file.into());
        self
    }

    /// Sets [`tls_cert_file`](Self::tls_cert_file), a PEM client certificate for mutual TLS;
    /// needs a key file. Unset by default.
    pub fn with_tls_cert_file(mut self, tls_cert_file: impl Into<PathBuf>) -> Self {
        self.tls_cert_file = Some(tls_cert_file.into());
        self
    }

    /// Sets [`tls_key_file`](Self::tls_key_file), the PEM private key of the client
    /// certificate. Unset by default.
    pub fn with_tls_key_file(mut self, tls_key_file: impl Into<PathBuf>) -> Self {
        self.tls_key_file = Some(tls_key_file.into());
        self
    }

    /// Sets [`tls_domain`](Self::tls_domain), the name the servers' certificates are checked
    /// against. Unset by default (the endpoint's host).
    pub fn with_tls_domain(mut self, tls_domain: impl Into<String>) -> Self {
        self.tls_domain = Some(tls_domain.into());
        self
    }

    /// Sets [`key_prefix`](Self::key_prefix), the start of every key the provider writes.
    /// Default `lockingkit/`.
    pub fn with_key_prefix(mut self, key_prefix: impl Into<String>) -> Self {
        self.key_prefix = key_prefix.into();
        self
    }

    /// Sets [`lease_ttl`](Self::lease_ttl), the TTL of the backend's etcd lease (2 s to 1 h,
    /// whole seconds). Default 30 s.
    pub fn with_lease_ttl(mut self, lease_ttl: Duration) -> Self {
        self.lease_ttl = lease_ttl;
        self
    }

    /// Sets [`request_timeout`](Self::request_timeout), the longest any one request (or
    /// connection attempt) may take, resends included. Default 5 s.
    pub fn with_request_timeout(mut self, request_timeout: Duration) -> Self {
        self.request_timeout = request_timeout;
        self
    }

    /// Whether the endpoints are reached over TLS.
    pub(super) fn uses_tls(&self) -> bool {
        self.endpoints.iter().any(|e| e.starts_with("https://"))
    }

    /// Lists every problem with these options, each about one of their settings. An empty
    /// list means the options are valid. No message quotes the password.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = self.endpoint_problems();
        match (&self.user, &self.password) {
            (Some(user), Some(_)) if user.trim().is_empty() => {
                problems.push(Problem::new("user", "must not be empty"));
            }
            (Some(_), None) => {
                problems.push(Problem::new("user", "needs a password").involving("password"))
            }
            (None, Some(_)) => {
                problems.push(Problem::new("password", "needs a user").involving("user"))
            }
            _ => {}
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            problems.push(
                Problem::new(
                    "tls_cert_file",
                    "and tls_key_file go together (mutual TLS needs both)",
                )
                .involving("tls_key_file"),
            );
        }
        let tls_set =
            self.tls_ca_file.is_some() || self.tls_cert_file.is_some() || self.tls_domain.is_some();
        if tls_set && !self.uses_tls() {
            problems.push(
                Problem::new(
                    "endpoints",
                    "must be https:// URLs for the tls_* settings to apply (they are ignored over http)",
                )
                .involving("tls_ca_file")
                .involving("tls_cert_file")
                .involving("tls_domain"),
            );
        }
        if self.key_prefix.is_empty() {
            problems.push(Problem::new(
                "key_prefix",
                "must not be empty (the provider's keys would mix with every other key in the cluster)",
            ));
        }
        if !(MIN_LEASE_TTL..=MAX_LEASE_TTL).contains(&self.lease_ttl)
            || self.lease_ttl.subsec_nanos() != 0
        {
            problems.push(Problem::new(
                "lease_ttl",
                format!(
                    "must be whole seconds from {}s to {}s",
                    MIN_LEASE_TTL.as_secs(),
                    MAX_LEASE_TTL.as_secs()
                ),
            ));
        }
        if self.request_timeout < Duration::from_millis(1) {
            problems.push(Problem::new("request_timeout", "must be at least 1ms"));
        } else {
            problems.extend(timeout_beyond_a_third_of_lease(
                "request_timeout",
                self.request_timeout,
                "lease_ttl",
                self.lease_ttl,
            ));
        }
        problems
    }

    fn endpoint_problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        if self.endpoints.is_empty() {
            problems.push(Problem::new("endpoints", "needs at least one URL"));
        }
        let schemes: Vec<bool> = self
            .endpoints
            .iter()
            .map(|e| e.starts_with("https://"))
            .collect();
        for (index, endpoint) in self.endpoints.iter().enumerate() {
            let host = endpoint
                .strip_prefix("http://")
                .or_else(|| endpoint.strip_prefix("https://"));
            let valid = host.is_some_and(|h| {
                !h.contains(['/', '?', '#', ' ', '@'])
                    && h.rsplit_once(':').is_some_and(|(host, port)| {
                        !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0)
                    })
            });
            if !valid {
                // About `endpoints`, so that it is left out when the list did not parse.
                problems.push(Problem::new(
                    format!("endpoints[{index}]"),
                    "must be a URL such as http://127.0.0.1:2379 (scheme http or https, host and port, no path)",
                ).involving("endpoints"));
            }
        }
        if schemes.iter().any(|s| *s) && !schemes.iter().all(|s| *s) {
            problems.push(Problem::new(
                "endpoints",
                "mixes http and https: use one scheme for the whole cluster",
            ));
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_setter_sets_the_setting_of_its_name() {
        let bound: EtcdOptions = serde_json::from_value(serde_json::json!({
            "endpoints": ["https://a:2379", "https://b:2379"],
            "user": "locks",
            "password": "hunter2",
            "tls_ca_file": "/etc/ca.pem",
            "tls_cert_file": "/etc/client.pem",
            "tls_key_file": "/etc/client.key",
            "tls_domain": "etcd.internal",
            "key_prefix": "app/",
            "lease_ttl": "10s",
            "request_timeout": "3s",
        }))
        .unwrap();
        let built = EtcdOptions::default()
            .with_endpoints(["https://a:2379", "https://b:2379"])
            .with_user("locks")
            .with_password("hunter2")
            .with_tls_ca_file("/etc/ca.pem")
            .with_tls_cert_file("/etc/client.pem")
            .with_tls_key_file("/etc/client.key")
            .with_tls_domain("etcd.internal")
            .with_key_prefix("app/")
            .with_lease_ttl(Duration::from_secs(10))
            .with_request_timeout(Duration::from_secs(3));
        assert_eq!(built, bound);
    }
}
