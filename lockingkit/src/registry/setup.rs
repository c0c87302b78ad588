//! What every provider is built with besides its backend, and how a backend becomes a
//! provider: wrapped in the engine like every other.

use opentelemetry::metrics::Meter;

use super::problem::Problem;
use crate::backend::{LeaseTiming, LockBackend};
use crate::engine::LockOptions;
use crate::lock::DistributedLock;

/// A provider, or every problem that kept it from being built.
pub(super) type ProviderResult = Result<DistributedLock, Vec<Problem>>;

/// A provider registered in code, built when the registry is.
pub(super) type Registration = Box<dyn FnOnce(ProviderSetup<'_>) -> ProviderResult + Send>;

/// The Microsoft Entra identity of Azure Blob providers that name a `service_url`.
#[cfg(feature = "azure")]
pub(super) type AzureCredential = std::sync::Arc<dyn azure_core::credentials::TokenCredential>;

/// What the host application hands every provider alike, through the builder.
#[derive(Clone, Copy)]
pub(super) struct HostResources<'a> {
    /// The meter to record on, instead of the global `lockingkit` meter.
    pub(super) meter: Option<&'a Meter>,
    /// The secret of key digests, if the host wants them.
    pub(super) key_digest: Option<&'a crate::telemetry::KeyDigest>,
    /// The identity for Azure sections that name a `service_url`.
    #[cfg(feature = "azure")]
    pub(super) azure_credential: Option<&'a AzureCredential>,
}

/// One named provider about to be built: everything but its backend.
pub(super) struct ProviderSetup<'a> {
    /// The registration name, such as `Jobs`.
    pub(super) name: &'a str,
    pub(super) options: LockOptions,
    pub(super) host: HostResources<'a>,
}

impl ProviderSetup<'_> {
    /// The provider's section, such as `Locking.Jobs`, which its problems are about.
    pub(super) fn path(&self) -> String {
        format!("Locking.{}", self.name)
    }

    /// Wraps `backend` in the engine, as every provider is.
    pub(super) fn assemble<B: LockBackend>(self, backend: B) -> ProviderResult {
        let path = self.path();
        // The engine would ignore it: a connection-held lock has no lease to renew, and a
        // setting that silently does nothing misleads whoever tunes it.
        if let (LeaseTiming::ConnectionHeld(_), Some(_)) =
            (backend.timing(), self.options.renew_every)
        {
            return Err(vec![renew_every_does_not_apply(&path, backend.provider())]);
        }
        let builder = DistributedLock::builder(backend)
            .name(self.name)
            .options(self.options)
            .with_key_digest(self.host.key_digest.cloned());
        match self.host.meter {
            Some(meter) => builder.meter(meter.clone()),
            None => builder,
        }
        .build()
        .map_err(|error| vec![Problem::from_error(&path, &error)])
    }
}

/// The problem of a renewal cadence set on a provider whose locks are not leases.
pub(super) fn renew_every_does_not_apply(path: &str, provider: &str) -> Problem {
    Problem::sentence(
        format!("{path}.renew_every"),
        format!(
            "does not apply to the {provider} provider: its locks are held by a connection, not \
             renewed as leases (remove it; how often the connection is checked is the \
             provider's own setting, check_interval for postgres)"
        ),
    )
}
