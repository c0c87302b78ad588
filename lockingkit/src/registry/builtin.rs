//! The providers a configuration file can name without registering anything.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::section::{bind_settings, problem_list, ProviderSection};
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

/// Binds `T` from the section and runs its own checks, with every problem listed.
fn bind_checked<T: serde::de::DeserializeOwned>(
    section: &ProviderSection,
    problems_of: impl Fn(&T, &str) -> Vec<String>,
) -> Result<T, LockError> {
    let mut problems = Vec::new();
    let bound = bind_settings::<T>(
        section.path(),
        section.provider(),
        section.settings(),
        &mut problems,
    );
    if let Some(options) = &bound {
        problems.extend(problems_of(options, section.path()));
    }
    match bound {
        Some(options) if problems.is_empty() => Ok(options),
        _ => Err(problem_list(problems)),
    }
}

fn in_memory(
    section: &ProviderSection,
    assembly: Assembly<'_>,
) -> Result<DistributedLock, LockError> {
    let options = bind_checked(section, MemoryOptions::problems)?;
    assembly.assemble(MemoryBackend::with_lease(
        MemoryStore::new(),
        options.lease_duration,
    ))
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
    let options = bind_checked(section, PostgresOptions::problems)?;
    let backend = PostgresBackend::new(options)
        .map_err(|e| retarget(&e, "Locking.Postgres", section.path()))?;
    assembly.assemble(backend)
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
    let options = bind_checked(section, AzureBlobOptions::problems)?;
    let backend = match (
        &options.service_url,
        assembly.context.azure_credential.cloned(),
    ) {
        (Some(_), Some(credential)) => AzureBlobBackend::with_credential(options, credential),
        (Some(_), None) => {
            return Err(problem_list(vec![format!(
                "{}.service_url needs a token credential: give one to \
                 LockingBuilder::azure_credential, or use connection_string",
                section.path()
            )]))
        }
        (None, _) => AzureBlobBackend::new(options),
    }
    .map_err(|e| retarget(&e, "AzureBlobOptions", section.path()))?;
    assembly.assemble(backend)
}

/// A provider constructor's error with its own section name replaced by the real one.
#[cfg(any(feature = "postgres", feature = "azure"))]
pub(super) fn retarget(error: &LockError, own: &str, path: &str) -> LockError {
    let message = error
        .message()
        .strip_prefix("invalid lock configuration: ")
        .unwrap_or(error.message());
    problem_list(vec![message.replace(own, path)])
}
