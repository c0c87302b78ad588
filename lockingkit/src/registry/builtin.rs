//! The providers a configuration file can name without registering anything.

use super::section::ProviderSection;
use super::setup::{ProviderResult, ProviderSetup};
use crate::backend::LockBackend;
use crate::config::Problem;
use crate::providers::memory::{MemoryBackend, MemoryOptions, MemoryStore};

/// A built-in provider: its configuration name and how to build it from a section.
pub(super) struct BuiltIn {
    pub(super) name: &'static str,
    pub(super) build: fn(&ProviderSection, ProviderSetup<'_>) -> ProviderResult,
}

/// Every built-in provider, whether or not its feature is enabled; a disabled one explains
/// which feature it needs instead of being an unknown provider.
pub(super) const BUILT_IN: &[BuiltIn] = &[
    BuiltIn {
        name: "in_memory",
        build: in_memory,
    },
    BuiltIn {
        name: "postgres",
        build: postgres,
    },
    BuiltIn {
        name: "azure_blob",
        build: azure_blob,
    },
    BuiltIn {
        name: "etcd",
        build: etcd,
    },
    BuiltIn {
        name: "redis",
        build: redis,
    },
];

/// Binds `T` from the section and runs its own checks on whatever bound, so one bad setting
/// hides no other problem. Returns the options when they can build a backend (everything
/// parsed and passed its checks; unknown settings aside), and every problem.
fn bind_checked<T: serde::de::DeserializeOwned>(
    section: &ProviderSection,
    problems_of: impl FnOnce(&T) -> Vec<Problem>,
    ranges: &[crate::config::WholeNumbers],
) -> (Option<T>, Vec<Problem>) {
    let bound = section.bind_recorded::<T>(ranges);
    let own = bound.checked(section.path(), problems_of);
    let usable = own.is_empty() && bound.unparsed.is_empty();
    let mut problems = bound.problems;
    problems.extend(own);
    (bound.value.filter(|_| usable), problems)
}

/// Builds the provider from options that can build a backend, even when other settings of
/// the section are wrong, so the engine's checks (renewal cadence against the lease) join the
/// same error; what is built is dropped unless there is no problem at all.
fn finish<B: LockBackend>(
    backend: Option<Result<B, Vec<Problem>>>,
    setup: ProviderSetup<'_>,
    mut problems: Vec<Problem>,
) -> ProviderResult {
    let path = setup.path();
    match backend.map(|backend| backend.and_then(|backend| setup.assemble(backend))) {
        Some(Ok(lock)) if problems.is_empty() => return Ok(lock),
        Some(Err(more)) => problems.extend(more),
        _ => {}
    }
    if problems.is_empty() {
        // Options that bound without a problem always make a backend; this only keeps a
        // failure from ever being silent.
        problems.push(Problem::new(path, "could not be built"));
    }
    Err(problems)
}

fn in_memory(section: &ProviderSection, setup: ProviderSetup<'_>) -> ProviderResult {
    let (options, problems) = bind_checked(section, MemoryOptions::problems, &[]);
    let backend = options.map(|options| {
        Ok(MemoryBackend::with_lease(
            MemoryStore::new(),
            options.lease_duration,
        ))
    });
    finish(backend, setup, problems)
}

/// The problem of a provider whose cargo feature is off.
#[cfg(not(all(
    feature = "postgres",
    feature = "azure",
    feature = "etcd",
    feature = "redis"
)))]
fn needs_feature(section: &ProviderSection, provider: &str, feature: &str) -> Vec<Problem> {
    vec![Problem::new(
        format!("{}.provider", section.path()),
        format!("is {provider}, which needs lockingkit's `{feature}` feature"),
    )]
}

#[cfg(not(feature = "postgres"))]
fn postgres(section: &ProviderSection, _: ProviderSetup<'_>) -> ProviderResult {
    Err(needs_feature(section, "postgres", "postgres"))
}

#[cfg(feature = "postgres")]
fn postgres(section: &ProviderSection, setup: ProviderSetup<'_>) -> ProviderResult {
    use crate::providers::postgres::PostgresOptions;
    let (options, problems) = bind_checked(
        section,
        PostgresOptions::problems,
        PostgresOptions::WHOLE_NUMBERS,
    );
    let mut problems = problems;
    if options.is_none() {
        // Its locks are connection-held whatever the options say: the engine's renewal rules
        // for such a backend apply even when its options are bad, so they join this error.
        let timing =
            crate::backend::LeaseTiming::ConnectionHeld(PostgresOptions::default().check_interval);
        let rules = crate::engine::problems_with(&setup.options, timing, "postgres");
        problems.extend(rules.into_iter().map(|problem| problem.at(section.path())));
    }
    let backend = options.map(|options| open_postgres(options, section.path()));
    finish(backend, setup, problems)
}

/// The PostgreSQL backend for the section at `path`, from options whose own checks passed.
#[cfg(feature = "postgres")]
pub(super) fn open_postgres(
    options: crate::providers::postgres::PostgresOptions,
    path: &str,
) -> Result<crate::providers::postgres::PostgresBackend, Vec<Problem>> {
    crate::providers::postgres::PostgresBackend::open(options)
        .map_err(|problems| problems.into_iter().map(|p| p.at(path)).collect())
}

#[cfg(not(feature = "azure"))]
fn azure_blob(section: &ProviderSection, _: ProviderSetup<'_>) -> ProviderResult {
    Err(needs_feature(section, "azure_blob", "azure"))
}

#[cfg(feature = "azure")]
fn azure_blob(section: &ProviderSection, setup: ProviderSetup<'_>) -> ProviderResult {
    use crate::providers::azure::AzureBlobOptions;
    let (options, problems) = bind_checked(
        section,
        AzureBlobOptions::problems,
        AzureBlobOptions::WHOLE_NUMBERS,
    );
    let backend = options.map(|options| open_azure(options, setup.host, section.path()));
    finish(backend, setup, problems)
}

/// The Azure Blob backend for the section at `path`, listing every problem with `options`.
#[cfg(feature = "azure")]
pub(super) fn open_azure(
    options: crate::providers::azure::AzureBlobOptions,
    host: super::setup::HostResources<'_>,
    path: &str,
) -> Result<crate::providers::azure::AzureBlobBackend, Vec<Problem>> {
    // The builder's credential is for sections that name a service_url; a connection
    // string carries its own.
    let credential = options
        .service_url
        .as_ref()
        .and(host.azure_credential.cloned());
    crate::providers::azure::AzureBlobBackend::open(options, credential)
        .map_err(|problems| problems.into_iter().map(|p| p.at(path)).collect())
}

#[cfg(not(feature = "etcd"))]
fn etcd(section: &ProviderSection, _: ProviderSetup<'_>) -> ProviderResult {
    Err(needs_feature(section, "etcd", "etcd"))
}

#[cfg(feature = "etcd")]
fn etcd(section: &ProviderSection, setup: ProviderSetup<'_>) -> ProviderResult {
    use crate::providers::etcd::EtcdOptions;
    let (options, problems) = bind_checked(section, EtcdOptions::problems, &[]);
    let path = section.path();
    let backend = options.map(|options| {
        // The constructor finds what the options cannot say alone (a TLS file it cannot read).
        crate::providers::etcd::EtcdBackend::open(options)
            .map_err(|problems| problems.into_iter().map(|p| p.at(path)).collect())
    });
    finish(backend, setup, problems)
}

#[cfg(not(feature = "redis"))]
fn redis(section: &ProviderSection, _: ProviderSetup<'_>) -> ProviderResult {
    Err(needs_feature(section, "redis", "redis"))
}

#[cfg(feature = "redis")]
fn redis(section: &ProviderSection, setup: ProviderSetup<'_>) -> ProviderResult {
    use crate::providers::redis::RedisOptions;
    // The writer's intent against the engine's max_retry_delay is the engine's rule, checked
    // when the provider is assembled, as for a `DistributedLock::builder`.
    let (options, problems) =
        bind_checked(section, RedisOptions::problems, RedisOptions::WHOLE_NUMBERS);
    let backend = options.map(|options| open_redis(options, section.path()));
    finish(backend, setup, problems)
}

/// The Redis backend for the section at `path`, listing every problem with `options`.
#[cfg(feature = "redis")]
pub(super) fn open_redis(
    options: crate::providers::redis::RedisOptions,
    path: &str,
) -> Result<crate::providers::redis::RedisBackend, Vec<Problem>> {
    crate::providers::redis::RedisBackend::open(options)
        .map_err(|problems| problems.into_iter().map(|p| p.at(path)).collect())
}
