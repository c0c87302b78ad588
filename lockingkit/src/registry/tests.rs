use std::time::Duration;

use serde_json::{json, Value};

use super::*;
use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend, LockMode};
use crate::config::SecretString;
use crate::engine::LockOptions;
use crate::providers::memory::{MemoryBackend, MemoryOptions, MemoryStore};

/// The options of a pooled provider, as the binder's and the probe's tests see them: a text, a
/// number, a flag and an optional duration, the duration alone with a default.
#[derive(Debug, serde::Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(super) struct Pool {
    pub(super) connection_string: String,
    pub(super) max_connections: u32,
    pub(super) tls: bool,
    #[serde(default, with = "crate::config::option_duration")]
    pub(super) check_every: Option<Duration>,
}

fn config(sections: Value) -> LockingConfig {
    serde_json::from_value(sections).unwrap()
}

fn misconfigured(result: Result<Locking, LockError>) -> String {
    match result {
        Ok(locking) => panic!("expected Misconfigured, built {locking:?}"),
        Err(error) => {
            assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
            error.to_string()
        }
    }
}

#[test]
fn providers_are_found_by_name_ignoring_case() {
    let locking = Locking::builder()
        .in_memory("Default")
        .in_memory("Jobs")
        .in_memory("Reports")
        .build()
        .unwrap();
    assert_eq!(locking.default_lock().name(), "Default");
    assert_eq!(locking.get("Jobs").map(DistributedLock::name), Some("Jobs"));
    assert_eq!(locking.get("jobs").map(DistributedLock::name), Some("Jobs"));
    assert_eq!(
        locking.get("REPORTS").map(DistributedLock::name),
        Some("Reports")
    );
    assert!(locking.get("Nightly").is_none());
    assert_eq!(
        locking.names().collect::<Vec<_>>(),
        ["Default", "Jobs", "Reports"]
    );
    assert_eq!(locking.len(), 3);
    assert_eq!(
        format!("{locking:?}"),
        r#"{"Default": "in_memory", "Jobs": "in_memory", "Reports": "in_memory"}"#
    );
}

#[test]
fn a_missing_name_is_a_clear_error() {
    let locking = Locking::builder()
        .in_memory("Default")
        .in_memory("Jobs")
        .build()
        .unwrap();
    let error = locking.require("Nightly").unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    assert_eq!(
        error.message(),
        "invalid lock configuration: no lock provider is named Nightly; configured: Default, Jobs"
    );
    assert_eq!(locking.require("jobs").unwrap().name(), "Jobs");
}

#[test]
fn default_comes_first_whatever_the_registration_order() {
    let locking = Locking::builder()
        .in_memory("Jobs")
        .in_memory("default")
        .build()
        .unwrap();
    assert_eq!(locking.default_lock().name(), "Default");
    assert_eq!(locking.names().collect::<Vec<_>>(), ["Default", "Jobs"]);
}

#[tokio::test]
async fn providers_are_independent_locks() {
    let locking = Locking::builder()
        .in_memory("Default")
        .in_memory("Jobs")
        .build()
        .unwrap();
    let held = locking
        .default_lock()
        .try_acquire("orders/42")
        .await
        .unwrap();
    // Jobs has its own store, so the same key is free there.
    let other = locking
        .get("Jobs")
        .unwrap()
        .try_acquire("orders/42")
        .await
        .unwrap();
    let busy = locking
        .default_lock()
        .try_acquire("orders/42")
        .await
        .unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::Busy);
    held.release().await.unwrap();
    other.release().await.unwrap();
}

#[test]
fn a_registry_needs_default() {
    let shown = misconfigured(Locking::builder().in_memory("Jobs").build());
    assert!(shown.contains("Locking.Default is missing"), "{shown}");
}

#[test]
fn required_names_fail_the_build_not_the_first_lock() {
    let shown = misconfigured(
        Locking::builder()
            .in_memory("Default")
            .required("Jobs")
            .required("default")
            .build(),
    );
    assert!(
        shown.contains("Locking.Jobs is missing, and this application requires it"),
        "{shown}"
    );
    assert!(!shown.contains("Locking.default"), "{shown}");
}

#[test]
fn names_given_twice_are_a_problem() {
    let shown = misconfigured(
        Locking::builder()
            .in_memory("Default")
            .in_memory("Jobs")
            .config(config(json!({"jobs": {"provider": "in_memory"}})))
            .build(),
    );
    assert!(
        shown.contains("Locking.jobs is defined twice (as Jobs too"),
        "{shown}"
    );
}

#[test]
fn sections_bind_whatever_the_case_of_names_and_settings() {
    let locking = Locking::from_config(config(json!({
        "DEFAULT": {"PROVIDER": "IN_MEMORY", "LEASE_DURATION": "20s", "MIN_RETRY_DELAY": "100ms"},
        "jobs": {"Provider": "InMemory", "MaxRetryDelay": "2s", "renew-every": "5s"},
    })))
    .unwrap();
    assert_eq!(locking.default_lock().name(), "Default");
    assert_eq!(locking.default_lock().provider(), "in_memory");
    let default = locking.default_lock().backend::<MemoryBackend>().unwrap();
    assert_eq!(
        default.timing(),
        LeaseTiming::Expiring(Duration::from_secs(20))
    );
    assert!(locking.get("Jobs").is_some());
}

#[test]
fn every_problem_of_every_section_is_listed_in_one_error() {
    let shown = misconfigured(Locking::from_config(config(json!({
        "Jobs": {
            "provider": "in_memory",
            "min_retry_delay": "5s",
            "max_retry_delay": "1s",
            "lease_duration": "0s",
        },
        "Reports": {"provider": "carrier_pigeon"},
        "Exports": {"max_retry_delay": "10ms"},
        "Audit": {"provider": "in_memory", "release_timeout": "soon", "colour": "blue"},
        "Broken": "not a table",
    }))));
    for expected in [
        "Locking.Jobs.min_retry_delay (5s) must not exceed max_retry_delay (1s)",
        "Locking.Exports.min_retry_delay (default 50ms) must not exceed max_retry_delay (10ms)",
        "Locking.Jobs.lease_duration must be at least 1ms",
        "Locking.Reports.provider carrier_pigeon is not a known provider (one of: in_memory, postgres, mysql, azure_blob, etcd, redis)",
        "Locking.Exports.provider is missing",
        "Locking.Audit.release_timeout:",
        "Locking.Audit.colour is not a setting of the in_memory provider",
        "Locking.Broken must be a table of settings",
        "Locking.Default is missing",
    ] {
        assert!(shown.contains(expected), "missing `{expected}` in: {shown}");
    }
    assert!(
        shown.starts_with("locking.misconfigured: invalid lock configuration: "),
        "{shown}"
    );
}

#[test]
fn renewal_cadence_is_checked_against_the_lease_at_build() {
    let shown = misconfigured(Locking::from_config(config(json!({
        "Default": {"provider": "in_memory", "lease_duration": "10s", "renew_every": "9s"},
    }))));
    assert!(
        shown.contains("Locking.Default.renew_every (9s) must be shorter than 90% of the lease"),
        "{shown}"
    );
}

#[test]
fn code_registered_options_are_validated_too() {
    let bad = LockOptions {
        min_retry_delay: Duration::ZERO,
        ..LockOptions::default()
    };
    let shown = misconfigured(
        Locking::builder()
            .backend("Default", MemoryBackend::new(MemoryStore::new()), bad)
            .build(),
    );
    assert!(
        shown.contains("Locking.Default.min_retry_delay must be greater than zero"),
        "{shown}"
    );
}

#[test]
fn providers_behind_disabled_features_say_which_feature() {
    #[cfg(not(feature = "postgres"))]
    {
        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {"provider": "postgres", "connection_string": "host=db"},
        }))));
        assert!(
            shown.contains("needs lockingkit's `postgres` feature"),
            "{shown}"
        );
    }
    #[cfg(not(feature = "azure"))]
    {
        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {"provider": "azure-blob"},
        }))));
        assert!(
            shown.contains("needs lockingkit's `azure` feature"),
            "{shown}"
        );
    }
}

/// A custom backend that counts on a real in-memory store underneath: what matters here is
/// that the registry hands it its section and wraps it in the engine.
struct Counted {
    inner: MemoryBackend,
}

impl LockBackend for Counted {
    type Lease = <MemoryBackend as LockBackend>::Lease;

    fn provider(&self) -> &str {
        "counted"
    }

    fn timing(&self) -> LeaseTiming {
        self.inner.timing()
    }

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<Self::Lease>>, BackendError> {
        self.inner.try_acquire(key, mode).await
    }

    async fn renew(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.inner.renew(lease).await
    }

    async fn release(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        self.inner.release(lease).await
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CountedOptions {
    #[serde(with = "crate::config::duration")]
    lease_duration: Duration,
    password: SecretString,
}

fn counted(section: &ProviderSection) -> Result<Counted, LockError> {
    let options: CountedOptions = section.bind()?;
    if options.password.expose() != "open sesame" {
        return Err(LockError::new(
            ErrorKind::Misconfigured,
            format!("{}.password is refused", section.path()),
        ));
    }
    Ok(Counted {
        inner: MemoryBackend::with_lease(MemoryStore::new(), options.lease_duration),
    })
}

#[tokio::test]
async fn a_custom_provider_is_selected_by_configuration_and_runs_in_the_engine() {
    let locking = Locking::builder()
        .custom_provider("counted", counted)
        .config(config(json!({
            "Default": {"provider": "in_memory"},
            "Jobs": {
                "provider": "Counted",
                "lease_duration": "2s",
                "PASSWORD": "open sesame",
                "max_retry_delay": "200ms",
            },
        })))
        .build()
        .unwrap();
    let jobs = locking.get("jobs").unwrap();
    assert_eq!(jobs.provider(), "counted");
    assert_eq!(jobs.name(), "Jobs");
    let held = jobs.try_acquire("nightly").await.unwrap();
    assert_eq!(
        jobs.try_acquire("nightly").await.unwrap_err().kind(),
        ErrorKind::Busy
    );
    held.release().await.unwrap();
    jobs.try_acquire("nightly")
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[test]
fn custom_provider_problems_join_the_one_error_without_their_secrets() {
    let secret = "Password=hunter2-very-secret";
    let shown = misconfigured(
        Locking::builder()
            .custom_provider("counted", counted)
            .config(config(json!({
                "Default": {"provider": "counted", "lease_duration": secret, "password": secret},
                "Jobs": {"provider": "counted", "lease_duration": "1s", "password": secret},
                "Audit": {"provider": "counted", "lease_duration": "1s"},
            })))
            .build(),
    );
    assert!(shown.contains("Locking.Default.lease_duration:"), "{shown}");
    assert!(
        shown.contains("Locking.Jobs.password is refused"),
        "{shown}"
    );
    assert!(
        shown.contains("Locking.Audit.password is required"),
        "{shown}"
    );
    assert!(!shown.contains("hunter2"), "{shown}");
}

#[test]
fn a_custom_provider_cannot_take_a_built_in_name() {
    let shown = misconfigured(
        Locking::builder()
            .in_memory("Default")
            .custom_provider("Azure-Blob", counted)
            .build(),
    );
    assert!(
        shown.contains("the custom provider Azure-Blob has the name of a built-in provider"),
        "{shown}"
    );
}

#[test]
fn memory_options_bind_and_check() {
    let options: MemoryOptions = serde_json::from_value(json!({"lease_duration": "15s"})).unwrap();
    assert_eq!(options.lease_duration, Duration::from_secs(15));
    assert_eq!(
        options,
        MemoryOptions::default().with_lease_duration(Duration::from_secs(15))
    );
    assert!(options.problems().is_empty());
    assert_eq!(
        MemoryOptions::default().lease_duration,
        Duration::from_secs(30)
    );
}

#[test]
fn secrets_stay_out_of_every_rendering_of_config_and_errors() {
    let secret = "AccountKey=c2VjcmV0LWtleQ==;Password=hunter2";
    let config = config(json!({
        "Default": {"provider": "in_memory", "connection_string": secret, "min_retry_delay": secret},
    }));
    let builder = Locking::builder().config(config.clone());
    let error = Locking::from_config(config.clone()).unwrap_err();
    for shown in [
        format!("{config:?}"),
        format!("{builder:?}"),
        format!("{error}"),
        format!("{error:?}"),
    ] {
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(!shown.contains("c2VjcmV0"), "{shown}");
    }
    assert!(error
        .to_string()
        .contains("Locking.Default.connection_string is not a setting"));
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    #[tokio::test]
    async fn postgres_sections_bind_build_and_report_under_their_own_name() {
        let locking = Locking::from_config(config(json!({
            "DEFAULT": {
                "PROVIDER": "postgres",
                "CONNECTION_STRING": "host=127.0.0.1 user=app password=hunter2 dbname=app",
                "MAX_SESSIONS": "2",
                "MAX_WAIT_SESSIONS": "8",
                "CHECK_INTERVAL": "2s",
            },
        })))
        .unwrap();
        assert_eq!(locking.default_lock().provider(), "postgres");
        let shown = format!(
            "{:?}",
            locking.default_lock().backend::<crate::PostgresBackend>()
        );
        assert!(shown.contains("max_sessions: 2"), "{shown}");
        assert!(!format!("{locking:?}").contains("hunter2"));

        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {"provider": "postgres", "max_sessions": 0},
            "Jobs": {
                "provider": "postgres",
                "connection_string": "postgres://app:hunter2@db/app?sslmode=sometimes",
                "fencing_schema": "Bad Schema",
            },
        }))));
        assert!(
            shown.contains("Locking.Default.connection_string is required"),
            "{shown}"
        );
        assert!(
            shown.contains("Locking.Default.max_sessions must be a whole number from 1 to 1024"),
            "{shown}"
        );
        assert!(shown.contains("Locking.Jobs.connection_string:"), "{shown}");
        assert!(
            shown.contains("Locking.Jobs.fencing_schema must be"),
            "{shown}"
        );
        assert!(!shown.contains("hunter2"), "{shown}");

        // A value that is no number states the same range as one out of range.
        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {"provider": "postgres", "connection_string": "host=db", "max_sessions": "abc"},
        }))));
        assert!(
            shown.contains("Locking.Default.max_sessions: expected a whole number from 1 to 1024"),
            "{shown}"
        );
    }

    #[test]
    fn postgres_in_code_is_validated_at_build_with_everything_else() {
        let shown = misconfigured(
            Locking::builder()
                .postgres(
                    "Default",
                    crate::PostgresOptions::new("password=hunter2 sslmode=bogus"),
                    LockOptions::default(),
                )
                .in_memory("Jobs")
                .in_memory("jobs")
                .build(),
        );
        assert!(
            shown.contains("Locking.Default.connection_string:"),
            "{shown}"
        );
        assert!(shown.contains("Locking.jobs is defined twice"), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}

#[cfg(feature = "azure")]
mod azure {
    use super::*;

    const ACCOUNT_KEY: &str = "c2VjcmV0LWFjY291bnQta2V5LWZvci10ZXN0cw==";

    #[tokio::test]
    async fn azure_sections_bind_build_and_report_under_their_own_name() {
        let connection_string = format!(
            "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={ACCOUNT_KEY};BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1"
        );
        let locking = Locking::from_config(config(json!({
            "default": {
                "provider": "AzureBlob",
                "ConnectionString": connection_string,
                "Container": "locks",
                "LeaseDuration": "20s",
            },
        })))
        .unwrap();
        assert_eq!(locking.default_lock().provider(), "azure_blob");

        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {
                "provider": "azure_blob",
                "connection_string": format!("AccountName=a;AccountKey={ACCOUNT_KEY};Bogus=1"),
                "lease_duration": "90s",
                "container": "Bad_Name",
            },
            "Jobs": {"provider": "azure_blob", "service_url": "https://acct.blob.core.windows.net"},
        }))));
        assert!(
            shown.contains(
                "Locking.Default.lease_duration must be between 15s and 60s (was 90s); \
                 infinite leases are not supported"
            ),
            "a provider's problem stays whole: {shown}"
        );
        assert!(!shown.contains("Locking.Default: infinite"), "{shown}");
        assert!(shown.contains("Locking.Default.container:"), "{shown}");
        assert!(
            shown.contains("Locking.Jobs.service_url needs a token credential"),
            "{shown}"
        );
        assert!(!shown.contains(ACCOUNT_KEY), "{shown}");
        assert!(!shown.contains("c2VjcmV0"), "{shown}");
    }
}

#[cfg(feature = "etcd")]
mod etcd {
    use super::*;

    #[test]
    fn etcd_in_code_is_checked_by_the_rules_of_its_section() {
        let mut etcd = crate::EtcdOptions::new(["http://127.0.0.1:2379"]);
        etcd.lease_ttl = std::time::Duration::ZERO;
        let in_code = misconfigured(
            Locking::builder()
                .etcd("Default", etcd, LockOptions::default())
                .build(),
        );
        let from_config = misconfigured(Locking::from_config(config(json!({
            "Default": {"provider": "etcd", "endpoints": "http://127.0.0.1:2379", "lease_ttl": "0s"},
        }))));
        assert!(in_code.contains("Locking.Default.lease_ttl"), "{in_code}");
        // A section is also told which values it did not write; code wrote them all.
        assert_eq!(in_code, from_config.replace("(default ", "("));
    }

    #[tokio::test]
    async fn etcd_sections_bind_build_and_report_under_their_own_name() {
        let locking = Locking::from_config(config(json!({
            "Default": {
                "Provider": "etcd",
                "Endpoints": ["http://127.0.0.1:2379", "http://127.0.0.1:22379"],
                "User": "locks",
                "Password": "hunter2",
                "LeaseTtl": "15s",
                "RequestTimeout": "2s",
            },
        })))
        .unwrap();
        assert_eq!(locking.default_lock().provider(), "etcd");
        assert!(!format!("{locking:?}").contains("hunter2"));

        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {
                "provider": "etcd",
                "endpoints": ["http://127.0.0.1:2379", "127.0.0.1:2380"],
                "password": "hunter2",
                "lease_ttl": "6s",
                "request_timeout": "3s",
            },
            "Jobs": {
                "provider": "etcd",
                "endpoints": ["https://10.0.0.1:2379"],
                "tls_ca_file": "/nonexistent/etcd-ca.pem",
            },
        }))));
        assert!(
            shown.contains("Locking.Default.endpoints[1] must be a URL such as"),
            "{shown}"
        );
        assert!(
            shown.contains("Locking.Default.password needs a user"),
            "{shown}"
        );
        assert!(
            shown.contains(
                "Locking.Default.request_timeout (3s) must be at most a third of lease_ttl (6s)"
            ),
            "{shown}"
        );
        assert!(
            shown.contains("Locking.Jobs.tls_ca_file: cannot read the file"),
            "the constructor's problem is placed in its section: {shown}"
        );
        assert!(!shown.contains("hunter2"), "{shown}");

        // A check that compares two settings is left out when one of them did not parse.
        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {
                "provider": "etcd",
                "endpoints": ["http://127.0.0.1:2379"],
                "lease_ttl": "soon",
                "request_timeout": "20s",
            },
        }))));
        assert!(shown.contains("Locking.Default.lease_ttl:"), "{shown}");
        assert!(!shown.contains("a third of lease_ttl"), "{shown}");
    }

    #[test]
    fn a_problem_about_a_default_the_section_did_not_write_names_it_as_the_default() {
        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {
                "provider": "etcd",
                "endpoints": ["http://127.0.0.1:2379"],
                "lease_ttl": "10s",
            },
        }))));
        assert!(
            shown.contains(
                "Locking.Default.request_timeout (default 5s) must be at most a third of \
                 lease_ttl (10s)"
            ),
            "{shown}"
        );
        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {
                "provider": "etcd",
                "endpoints": ["http://127.0.0.1:2379"],
                "RequestTimeout": "12s",
            },
        }))));
        assert!(
            shown.contains(
                "Locking.Default.request_timeout (12s) must be at most a third of lease_ttl \
                 (default 30s)"
            ),
            "{shown}"
        );
    }
}

#[test]
fn later_sources_override_earlier_ones_setting_by_setting_ignoring_case() {
    let file = config(json!({
        "Default": {"provider": "in_memory", "lease_duration": "30s", "max_retry_delay": "2s"},
        "Jobs": {"provider": "in_memory"},
    }));
    let env = config(json!({
        "default": {"LEASE_DURATION": "20s"},
        "reports": {"provider": "in_memory"},
    }));
    let locking = Locking::builder().config(file).config(env).build().unwrap();
    // `reports`, written in one case as environment variables arrive, is shown capitalised.
    assert_eq!(
        locking.names().collect::<Vec<_>>(),
        ["Default", "Jobs", "Reports"]
    );
    let default = locking.default_lock().backend::<MemoryBackend>().unwrap();
    assert_eq!(
        default.timing(),
        LeaseTiming::Expiring(Duration::from_secs(20))
    );
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;

    #[tokio::test]
    async fn mysql_sections_bind_build_and_report_under_their_own_name() {
        let locking = Locking::from_config(config(json!({
            "Default": {
                "Provider": "mysql",
                "ConnectionString": "mysql://app:hunter2@db.internal:3306/app",
                "MaxSessions": 2,
                "CheckInterval": "2s",
                "FencingTable": "locks_fencing",
            },
        })))
        .unwrap();
        assert_eq!(locking.default_lock().provider(), "mysql");
        assert!(!format!("{locking:?}").contains("hunter2"));

        let shown = misconfigured(Locking::from_config(config(json!({
            "Default": {
                "provider": "mysql",
                "connection_string": "postgres://app:hunter2@db/app",
                "max_sessions": 0,
                "fencing_table": "Locks; DROP TABLE x",
                "renew_every": "1s",
            },
        }))));
        for setting in [
            "connection_string",
            "max_sessions",
            "fencing_table",
            "renew_every",
        ] {
            assert!(
                shown.contains(&format!("Locking.Default.{setting}")),
                "{shown}"
            );
        }
        assert!(!shown.contains("hunter2"), "{shown}");
    }
}
