//! The providers a configuration file can name without registering anything.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::section::{problem_list, ProviderSection};
use super::Assembly;
use crate::error::LockError;
use crate::lock::DistributedLock;
use crate::providers::memory::{MemoryBackend, MemoryStore, DEFAULT_LEASE};

/// Options of the in-memory provider (`provider = "in_memory"`).
///
/// Each in-memory provider built from configuration has its own store, so it only excludes
/// callers in this process: use it for tests and local development, not to coordinate
/// several instances of a service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryOptions {
    /// How long a lease lasts unless renewed (30 s by default, as for Azure).
    #[serde(with = "crate::config::duration")]
    pub lease_duration: Duration,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        MemoryOptions {
            lease_duration: DEFAULT_LEASE,
        }
    }
}

impl MemoryOptions {
    /// Lists every problem with these options, prefixed with `section`.
    pub fn problems(&self, section: &str) -> Vec<String> {
        let mut problems = Vec::new();
        if self.lease_duration < Duration::from_millis(1) {
            problems.push(format!("{section}.lease_duration must be at least 1ms"));
        }
        problems
    }
}

/// A built-in provider: its configuration name and how to build it from a section.
pub(super) struct BuiltIn {
    pub(super) name: &'static str,
    pub(super) build: fn(&ProviderSection, Assembly<'_>) -> Result<DistributedLock, LockError>,
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
];

/// Binds `T` from the section and runs its own checks on whatever bound, so one bad setting
/// hides no other problem. Returns the options when they can build a backend (everything
/// parsed and passed its checks; unknown settings aside), and every problem.
fn bind_checked<T: serde::de::DeserializeOwned>(
    section: &ProviderSection,
    problems_of: impl Fn(&T, &str) -> Vec<String>,
) -> (Option<T>, Vec<String>) {
    let bound = section.bind_recorded::<T>();
    let mut problems: Vec<String> = bound.problems.iter().map(ToString::to_string).collect();
    let own = bound.checked(|options| problems_of(options, section.path()));
    let usable = own.is_empty() && bound.unparsed.is_empty();
    problems.extend(own);
    (bound.value.filter(|_| usable), problems)
}

/// Builds the provider from options that can build a backend, even when other settings of
/// the section are wrong, so the engine's checks (renewal cadence against the lease) join the
/// same error; what is built is dropped unless there is no problem at all.
fn finish<B: crate::backend::LockBackend>(
    backend: Option<Result<B, LockError>>,
    assembly: Assembly<'_>,
    mut problems: Vec<String>,
) -> Result<DistributedLock, LockError> {
    let built = match backend {
        Some(Ok(backend)) => Some(assembly.assemble(backend)),
        Some(Err(error)) => Some(Err(error)),
        None => None,
    };
    match built {
        Some(Ok(lock)) if problems.is_empty() => return Ok(lock),
        Some(Err(error)) => problems.push(own_message(&error).to_owned()),
        _ => {}
    }
    Err(problem_list(problems))
}

/// A `Misconfigured` error's problems without the engine's preamble.
pub(super) fn own_message(error: &LockError) -> &str {
    error
        .message()
        .strip_prefix("invalid lock configuration: ")
        .unwrap_or(error.message())
}

fn in_memory(
    section: &ProviderSection,
    assembly: Assembly<'_>,
) -> Result<DistributedLock, LockError> {
    let (options, problems) = bind_checked(section, MemoryOptions::problems);
    let backend = options.map(|options| {
        Ok(MemoryBackend::with_lease(
            MemoryStore::new(),
            options.lease_duration,
        ))
    });
    finish(backend, assembly, problems)
}

#[cfg(not(feature = "postgres"))]
fn postgres(section: &ProviderSection, _: Assembly<'_>) -> Result<DistributedLock, LockError> {
    Err(problem_list(vec![format!(
        "{}.provider is postgres, which needs lockingkit's `postgres` feature",
        section.path()
    )]))
}

#[cfg(feature = "postgres")]
fn postgres(
    section: &ProviderSection,
    assembly: Assembly<'_>,
) -> Result<DistributedLock, LockError> {
    use crate::providers::postgres::{PostgresBackend, PostgresOptions};
    let (options, problems) = bind_checked(section, PostgresOptions::problems);
    let backend = options.map(|options| {
        PostgresBackend::new(options).map_err(|e| retarget(&e, "PostgresOptions", section.path()))
    });
    finish(backend, assembly, problems)
}

#[cfg(not(feature = "azure"))]
fn azure_blob(section: &ProviderSection, _: Assembly<'_>) -> Result<DistributedLock, LockError> {
    Err(problem_list(vec![format!(
        "{}.provider is azure_blob, which needs lockingkit's `azure` feature",
        section.path()
    )]))
}

#[cfg(feature = "azure")]
fn azure_blob(
    section: &ProviderSection,
    assembly: Assembly<'_>,
) -> Result<DistributedLock, LockError> {
    use crate::providers::azure::{AzureBlobBackend, AzureBlobOptions};
    let (options, mut problems) = bind_checked(section, AzureBlobOptions::problems);
    let credential = assembly.context.azure_credential.cloned();
    let backend = match (options, credential) {
        (Some(options), Some(credential)) if options.service_url.is_some() => {
            Some(AzureBlobBackend::with_credential(options, credential))
        }
        (Some(options), None) if options.service_url.is_some() => {
            problems.push(format!(
                "{}.service_url needs a token credential: give one to \
                 LockingBuilder::azure_credential, or use connection_string",
                section.path()
            ));
            None
        }
        (options, _) => options.map(AzureBlobBackend::new),
    }
    .map(|backend| backend.map_err(|e| retarget(&e, "AzureBlobOptions", section.path())));
    finish(backend, assembly, problems)
}

/// A provider constructor's error with its own section name replaced by the real one.
#[cfg(any(feature = "postgres", feature = "azure"))]
pub(super) fn retarget(error: &LockError, own: &str, path: &str) -> LockError {
    problem_list(vec![own_message(error).replace(own, path)])
}
