//! Named providers bound from a TOML file and from environment variables with the `config`
//! crate, validated at startup into one error, and never showing a secret.
//!
//! Environment variables come from an explicit map (`Environment::source`), so the tests
//! neither read nor mutate the process environment.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use config::{Config, Environment, File};
use lockingkit::backend::{LeaseTiming, LockBackend};
use lockingkit::providers::memory::MemoryOptions;
use lockingkit::registry::ProviderSection;
use lockingkit::{
    AzureBlobOptions, ErrorKind, LockError, LockOptions, Locking, LockingConfig, MemoryBackend,
    MemoryStore, PostgresOptions,
};
use lockingkit_tests::checks::assert_mentions;

const PG_PASSWORD: &str = "pg-hunter2-from-file";
const ENV_PASSWORD: &str = "pg-hunter2-from-env";
const ACCOUNT_KEY: &str = "c2VjcmV0LWFjY291bnQta2V5LWZvci10ZXN0cw==";

/// A TOML file in a directory of its own, removed when dropped.
struct TomlFile {
    path: PathBuf,
}

impl TomlFile {
    fn new(name: &str, text: &str) -> TomlFile {
        let path = std::env::temp_dir().join(format!(
            "lockingkit-config-{}-{name}.toml",
            std::process::id()
        ));
        std::fs::write(&path, text).expect("temp dir is writable");
        TomlFile { path }
    }

    /// The `Locking` section of the file, as a host would bind it.
    fn locking(&self) -> LockingConfig {
        Config::builder()
            .add_source(File::from(self.path.as_path()))
            .build()
            .expect("the file parses")
            .get("Locking")
            .expect("the Locking section binds")
    }
}

impl Drop for TomlFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The `LOCKING__…` variables of `vars`, as a host would bind them with
/// `Environment::with_prefix("LOCKING").separator("__")`.
fn environment(vars: &[(&str, &str)]) -> LockingConfig {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Config::builder()
        .add_source(
            Environment::with_prefix("LOCKING")
                .separator("__")
                .source(Some(vars)),
        )
        .build()
        .expect("the environment parses")
        .try_deserialize()
        .expect("the environment binds")
}

fn file_text() -> String {
    format!(
        r#"
# The application's own settings sit beside LockingKit's.
[Server]
port = 8080

[Locking.Default]
provider = "postgres"
connection_string = "host=127.0.0.1 port=5432 user=app password={PG_PASSWORD} dbname=app"
max_sessions = 8
check_interval = "2s"
max_retry_delay = "2s"

[Locking.Jobs]
provider = "azure_blob"
connection_string = "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={ACCOUNT_KEY};BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1"
container = "job-locks"
lease_duration = "20s"

[Locking.Scratch]
provider = "in_memory"
lease_duration = "30s"
"#
    )
}

fn lease_of(locking: &Locking, name: &str) -> Duration {
    let backend = locking
        .get(name)
        .and_then(|lock| lock.backend::<MemoryBackend>())
        .expect("an in-memory provider");
    match backend.timing() {
        LeaseTiming::Expiring(lease) => lease,
        other => panic!("in-memory leases expire, got {other:?}"),
    }
}

fn misconfigured(result: Result<Locking, LockError>) -> String {
    match result {
        Ok(locking) => panic!("expected Misconfigured, built {locking:?}"),
        Err(error) => {
            assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
            format!("{error}")
        }
    }
}

#[tokio::test]
async fn named_providers_bind_from_a_toml_file() {
    let file = TomlFile::new("bind", &file_text());
    let locking = Locking::from_config(file.locking()).unwrap();

    assert_eq!(
        locking.names().collect::<Vec<_>>(),
        ["Default", "Jobs", "Scratch"]
    );
    assert_eq!(locking.default_lock().provider(), "postgres");
    assert_eq!(locking.get("Jobs").unwrap().provider(), "azure_blob");
    assert_eq!(locking.get("jobs").unwrap().name(), "Jobs");
    assert_eq!(lease_of(&locking, "Scratch"), Duration::from_secs(30));
    assert!(locking.get("Server").is_none());
    let missing = locking.require("Reports").unwrap_err();
    assert_eq!(missing.kind(), ErrorKind::Misconfigured);
    assert!(missing
        .message()
        .contains("configured: Default, Jobs, Scratch"));

    // The registry works: the in-memory provider takes and releases a lock.
    let scratch = locking.require("scratch").unwrap();
    let held = scratch.try_acquire("orders/42").await.unwrap();
    held.release().await.unwrap();
}

#[tokio::test]
async fn environment_variables_override_the_file_setting_by_setting() {
    let file = TomlFile::new("override", &file_text());
    let env = environment(&[
        ("LOCKING__SCRATCH__LEASE_DURATION", "15s"),
        ("LOCKING__AUDIT__PROVIDER", "in_memory"),
        ("LOCKING__AUDIT__LEASE_DURATION", "45s"),
        ("UNRELATED__SETTING", "ignored"),
    ]);
    let locking = Locking::builder()
        .config(file.locking())
        .config(env)
        .build()
        .unwrap();

    assert_eq!(lease_of(&locking, "Scratch"), Duration::from_secs(15));
    assert_eq!(lease_of(&locking, "audit"), Duration::from_secs(45));
    // The file's spelling of a name is kept; the environment's `audit` (lower-cased by the
    // `config` crate) is shown capitalised, as the docs spell section names.
    assert_eq!(
        locking.names().collect::<Vec<_>>(),
        ["Default", "Jobs", "Scratch", "Audit"]
    );
}

#[tokio::test]
async fn a_provider_binds_from_environment_variables_alone() {
    let env = environment(&[
        ("LOCKING__DEFAULT__PROVIDER", "postgres"),
        (
            "LOCKING__DEFAULT__CONNECTION_STRING",
            &format!("postgres://app:{ENV_PASSWORD}@127.0.0.1:5432/app"),
        ),
        // Environment variables are strings; numbers and durations still bind.
        ("LOCKING__DEFAULT__MAX_SESSIONS", "3"),
        ("LOCKING__DEFAULT__QUERY_TIMEOUT", "750ms"),
        ("LOCKING__DEFAULT__MIN_RETRY_DELAY", "20ms"),
    ]);
    let locking = Locking::from_config(env).unwrap();
    assert_eq!(locking.default_lock().name(), "Default");
    assert_eq!(locking.default_lock().provider(), "postgres");
    let backend = locking
        .default_lock()
        .backend::<lockingkit::PostgresBackend>();
    let shown = format!("{backend:?}");
    assert!(shown.contains("max_sessions: 3"), "{shown}");
    assert!(!format!("{locking:?}").contains(ENV_PASSWORD));
}

#[tokio::test]
async fn a_list_setting_binds_from_one_variable_separated_by_commas_or_from_numbered_ones() {
    let endpoints = r#"endpoints: ["http://127.0.0.1:2379", "http://127.0.0.1:22379"]"#;
    for vars in [
        vec![(
            "LOCKING__DEFAULT__ENDPOINTS",
            "http://127.0.0.1:2379, http://127.0.0.1:22379",
        )],
        vec![
            ("LOCKING__DEFAULT__ENDPOINTS__1", "http://127.0.0.1:22379"),
            ("LOCKING__DEFAULT__ENDPOINTS__0", "http://127.0.0.1:2379"),
        ],
    ] {
        let mut vars = vars;
        vars.push(("LOCKING__DEFAULT__PROVIDER", "etcd"));
        let locking = Locking::from_config(environment(&vars)).unwrap();
        let backend = locking
            .default_lock()
            .backend::<lockingkit::EtcdBackend>()
            .expect("an etcd provider");
        let shown = format!("{backend:?}");
        assert!(shown.contains(endpoints), "{vars:?}: {shown}");
    }
    // Each item is checked on its own, at its place in the list.
    let shown = misconfigured(Locking::from_config(environment(&[
        ("LOCKING__DEFAULT__PROVIDER", "etcd"),
        ("LOCKING__DEFAULT__ENDPOINTS__0", "http://127.0.0.1:2379"),
        ("LOCKING__DEFAULT__ENDPOINTS__1", "127.0.0.1:22379"),
    ])));
    assert!(
        shown.contains("Locking.Default.endpoints[1] must be a URL"),
        "{shown}"
    );
    // A gap in the numbers is no list: it is as likely a typo.
    let shown = misconfigured(Locking::from_config(environment(&[
        ("LOCKING__DEFAULT__PROVIDER", "etcd"),
        ("LOCKING__DEFAULT__ENDPOINTS__0", "http://127.0.0.1:2379"),
        ("LOCKING__DEFAULT__ENDPOINTS__2", "http://127.0.0.1:22379"),
    ])));
    assert!(
        shown.contains("Locking.Default.endpoints: expected a list"),
        "{shown}"
    );
}

#[tokio::test]
async fn redis_cluster_nodes_bind_from_one_variable_separated_by_commas() {
    let locking = Locking::from_config(environment(&[
        ("LOCKING__DEFAULT__PROVIDER", "redis"),
        ("LOCKING__DEFAULT__CLUSTER", "true"),
        (
            "LOCKING__DEFAULT__URL",
            "redis://127.0.0.1:7000,redis://127.0.0.1:7001",
        ),
    ]))
    .unwrap();
    assert_eq!(locking.default_lock().provider(), "redis");
}

#[tokio::test]
async fn a_secret_kept_out_of_the_file_comes_from_the_environment() {
    let file = TomlFile::new(
        "secretless",
        r#"
[Locking.Default]
provider = "postgres"
max_sessions = 4
"#,
    );
    let shown = misconfigured(Locking::from_config(file.locking()));
    assert!(
        shown.contains("Locking.Default.connection_string is required"),
        "{shown}"
    );

    let env = environment(&[(
        "LOCKING__DEFAULT__CONNECTION_STRING",
        &format!("host=127.0.0.1 user=app password={ENV_PASSWORD}"),
    )]);
    let locking = Locking::builder()
        .config(file.locking())
        .config(env)
        .build()
        .unwrap();
    assert_eq!(locking.default_lock().provider(), "postgres");
}

#[test]
fn every_problem_across_file_and_environment_is_listed_in_one_startup_error() {
    let file = TomlFile::new(
        "problems",
        &format!(
            r#"
[Locking.Default]
provider = "postgres"
connection_string = "postgres://app:{PG_PASSWORD}@db/app?sslmode=sometimes"
max_sessions = 0

[Locking.Jobs]
provider = "azure_blob"
connection_string = "AccountName=acct;AccountKey={ACCOUNT_KEY}"
lease_duration = "90s"
min_retry_delay = "5s"
max_retry_delay = "1s"

[Locking.Reports]
provider = "carrier_pigeon"

[Locking.Scratch]
provider = "in_memory"
lease = "30s"
"#
        ),
    );
    let env = environment(&[
        ("LOCKING__SCRATCH__RELEASE_TIMEOUT", "whenever"),
        ("LOCKING__EXPORTS__MAX_RETRY_DELAY", "1s"),
    ]);
    let shown = misconfigured(
        Locking::builder()
            .config(file.locking())
            .config(env)
            .required("Billing")
            .build(),
    );
    let expected = [
        "Locking.Default.connection_string:",
        "Locking.Default.max_sessions must be a whole number from 1 to 1024",
        "Locking.Jobs.lease_duration must be between 15s and 60s",
        "Locking.Jobs.min_retry_delay (5s) must not exceed max_retry_delay (1s)",
        "Locking.Reports.provider carrier_pigeon is not a known provider",
        "Locking.Scratch.lease is not a setting of the in_memory provider",
        "Locking.Scratch.release_timeout:",
        "Locking.Exports.provider is missing",
        "Locking.Billing is missing, and this application requires it",
    ];
    for problem in expected {
        assert!(shown.contains(problem), "missing `{problem}` in:\n{shown}");
    }
    assert!(!shown.contains(PG_PASSWORD), "{shown}");
    assert!(!shown.contains(ACCOUNT_KEY), "{shown}");
}

#[test]
fn no_options_type_or_error_shows_a_secret() {
    let pg = PostgresOptions::new(format!("host=db user=app password={PG_PASSWORD}"));
    let azure = AzureBlobOptions::from_connection_string(format!(
        "AccountName=acct;AccountKey={ACCOUNT_KEY}"
    ));
    let file = TomlFile::new("redaction", &file_text());
    let config = file.locking();
    let locking = Locking::builder()
        .config(config.clone())
        .build()
        .map(|l| format!("{l:?}"))
        .unwrap_or_else(|e| panic!("{e}"));

    // A secret in the wrong place is rejected without being repeated.
    let misplaced = misconfigured(Locking::from_config(environment(&[
        ("LOCKING__DEFAULT__PROVIDER", "in_memory"),
        ("LOCKING__DEFAULT__LEASE_DURATION", PG_PASSWORD),
        ("LOCKING__DEFAULT__PASSWORD", PG_PASSWORD),
    ])));
    // A custom provider's section and errors are as careful.
    let seen_section = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let seen = seen_section.clone();
    let custom = Locking::builder()
        .custom_provider("vault", move |section: &ProviderSection| {
            *seen.lock().unwrap() = format!("{section:?}");
            #[derive(serde::Deserialize)]
            #[allow(dead_code)]
            struct VaultOptions {
                token: lockingkit::config::SecretString,
                retries: u32,
            }
            let _: VaultOptions = section.bind()?;
            Ok(MemoryBackend::new(MemoryStore::new()))
        })
        .config(
            serde_json::from_value(serde_json::json!({
                "Default": {"provider": "vault", "token": PG_PASSWORD, "retries": ACCOUNT_KEY},
            }))
            .unwrap(),
        )
        .build();
    let custom = misconfigured(custom);

    let rendered = [
        format!("{pg:?}"),
        format!("{azure:?}"),
        format!("{:?}", MemoryOptions::default()),
        format!("{config:?}"),
        locking,
        misplaced,
        custom,
        seen_section.lock().unwrap().clone(),
    ];
    for shown in &rendered {
        assert!(!shown.contains(PG_PASSWORD), "{shown}");
        assert!(!shown.contains(ACCOUNT_KEY), "{shown}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }
    assert!(
        rendered[5].contains("Locking.Default.lease_duration:"),
        "{}",
        rendered[5]
    );
    assert!(
        rendered[6].contains("Locking.Default.retries:"),
        "{}",
        rendered[6]
    );
}

#[test]
fn a_setting_that_does_not_parse_hides_no_other_problem_of_its_section() {
    let file = TomlFile::new(
        "one-round",
        r#"
[Locking.Default]
provider = "postgres"
connection_string = "host=127.0.0.1 user=app"
max_sessions = -1
check_interval = "0s"

[Locking.Jobs]
provider = "in_memory"
lease_duration = "10s"
renew_every = "9s"
lease_duraton = "20s"

[Locking.Reports]
provider = "in_memory"
min_retry_delay = "soon"
max_retry_delay = "0s"
renew_every = "40s"
"#,
    );
    let shown = misconfigured(Locking::from_config(file.locking()));
    for expected in [
        "Locking.Default.max_sessions: expected a whole number from 1 to 1024",
        "Locking.Default.check_interval must be greater than zero",
        "Locking.Jobs.lease_duraton is not a setting of the in_memory provider",
        "Locking.Jobs.renew_every (9s) must be shorter than 90% of the lease (10s)",
        "Locking.Reports.min_retry_delay: expected a duration",
        "Locking.Reports.renew_every (40s) must be shorter than 90% of the lease (30s)",
    ] {
        assert!(
            shown.contains(expected),
            "missing `{expected}` in:\n{shown}"
        );
    }
    // A check that involves a setting that did not parse would judge its default instead.
    assert!(
        !shown.contains("must not exceed max_retry_delay"),
        "{shown}"
    );
}

#[test]
fn a_duration_that_does_not_parse_says_what_to_write_instead() {
    for bad in ["1.5", "5000", r#""5""#, r#""5 fortnights""#, "[30]"] {
        let file = TomlFile::new(
            "durations",
            &format!("[Locking.Default]\nprovider = \"in_memory\"\nlease_duration = {bad}\n"),
        );
        let shown = misconfigured(Locking::from_config(file.locking()));
        assert!(
            shown.contains(
                r#"Locking.Default.lease_duration: expected a duration with its unit, such as "30s" or "250ms""#
            ),
            "{bad}: {shown}"
        );
        assert!(!shown.contains("untagged"), "{bad}: {shown}");
    }
}

#[test]
fn a_negative_duration_is_refused_as_negative() {
    for negative in ["-5", r#""-1s""#] {
        let file = TomlFile::new(
            "negative",
            &format!("[Locking.Default]\nprovider = \"in_memory\"\nlease_duration = {negative}\n"),
        );
        let shown = misconfigured(Locking::from_config(file.locking()));
        assert!(
            shown.contains("Locking.Default.lease_duration must not be negative"),
            "{negative}: {shown}"
        );
        assert!(!shown.contains("no unit"), "{negative}: {shown}");
    }
    let env = environment(&[
        ("LOCKING__DEFAULT__PROVIDER", "in_memory"),
        ("LOCKING__DEFAULT__MIN_RETRY_DELAY", "-1s"),
    ]);
    let shown = misconfigured(Locking::from_config(env));
    assert!(
        shown.contains("Locking.Default.min_retry_delay must not be negative"),
        "{shown}"
    );
}

#[test]
fn a_problem_about_a_default_names_the_default_and_both_values() {
    let env = environment(&[
        ("LOCKING__DEFAULT__PROVIDER", "etcd"),
        ("LOCKING__DEFAULT__ENDPOINTS", "http://127.0.0.1:2379"),
        ("LOCKING__DEFAULT__LEASE_TTL", "10s"),
    ]);
    let shown = misconfigured(Locking::from_config(env));
    assert!(
        shown.contains(
            "Locking.Default.request_timeout (default 5s) must be at most a third of lease_ttl (10s)"
        ),
        "{shown}"
    );
}

#[test]
fn renew_every_is_refused_where_locks_are_held_by_a_connection() {
    let from_file = TomlFile::new(
        "renew-postgres",
        r#"
[Locking.Default]
provider = "postgres"
connection_string = "host=127.0.0.1 user=app"
renew_every = "5s"

[Locking.Jobs]
provider = "postgres"
renew_every = "5s"
"#,
    );
    let shown = misconfigured(Locking::from_config(from_file.locking()));
    assert!(
        shown.contains(
            "Locking.Default.renew_every does not apply to the postgres provider: its locks are \
             held by a connection"
        ),
        "{shown}"
    );
    // Reported next to the section's other problems, and once.
    assert!(
        shown.contains("Locking.Jobs.connection_string is required"),
        "{shown}"
    );
    assert_eq!(
        shown
            .matches("Locking.Jobs.renew_every does not apply")
            .count(),
        1,
        "{shown}"
    );

    let in_code = misconfigured(
        Locking::builder()
            .postgres(
                "Default",
                PostgresOptions::new("host=127.0.0.1 user=app"),
                LockOptions::default().with_renew_every(Duration::from_secs(5)),
            )
            .build(),
    );
    assert!(
        in_code.contains("Locking.Default.renew_every does not apply to the postgres provider"),
        "{in_code}"
    );
}

#[test]
fn sections_from_environment_variables_are_named_as_the_docs_spell_them() {
    let shown = misconfigured(
        Locking::builder()
            .config(environment(&[
                ("LOCKING__DEFAULT__PROVIDER", "in_memory"),
                ("LOCKING__REPORTS__PROVIDER", "carrier_pigeon"),
                ("LOCKING__NIGHTLY_JOBS__LEASE_DURATION", "soon"),
            ]))
            .build(),
    );
    assert_mentions(
        &shown,
        &[
            "Locking.Reports.provider carrier_pigeon is not a known provider",
            "Locking.Nightly_jobs.provider is missing",
        ],
    );
    assert!(!shown.contains("Locking.reports"), "{shown}");
}

#[test]
fn only_secrets_are_redacted_and_a_harmless_name_is_shown() {
    let file = TomlFile::new(
        "redact-by-field",
        &format!(
            r#"
[Locking.Az]
provider = "azure_blob"
connection_string = "AccountName=acct;AccountKey={ACCOUNT_KEY};BlobEndpoint=http://127.0.0.1:1/acct"
container = "Job_Locks_2024"
"#
        ),
    );
    let shown = misconfigured(Locking::from_config(file.locking()));
    assert!(
        shown.contains("Locking.Az.container: `Job_Locks_2024` is not a valid container name"),
        "{shown}"
    );
    assert!(!shown.contains("[redacted]"), "{shown}");
    assert!(!shown.contains(ACCOUNT_KEY), "{shown}");
}
