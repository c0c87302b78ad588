//! What every provider is built with besides its backend, and how a backend becomes a
//! provider: wrapped in the engine like every other.

use opentelemetry::metrics::Meter;

use crate::backend::LockBackend;
use crate::config::Problem;
use crate::engine::LockOptions;
use crate::lock::DistributedLock;

/// A provider, or every problem that kept it from being built.
pub(super) type ProviderResult = Result<DistributedLock, Vec<Problem>>;

/// A provider registered in code, built when the registry is.
pub(super) type Registration = Box<dyn FnOnce(ProviderSetup<'_>) -> ProviderResult + Send>;

/// The Microsoft Entra identity of Azure Blob providers that name a `service_url`.
#[cfg(feature = "azure")]
pub(crate) type AzureCredential = std::sync::Arc<dyn azure_core::credentials::TokenCredential>;

/// What the host application hands every provider alike, through the builder.
#[derive(Clone, Copy)]
pub(crate) struct HostResources<'a> {
    /// The meter to record on, instead of the global `lockingkit` meter.
    pub(crate) meter: Option<&'a Meter>,
    /// The secret of key digests, if the host wants them.
    pub(crate) key_digest: Option<&'a crate::telemetry::KeyDigest>,
    /// The identity for Azure sections that name a `service_url`.
    #[cfg(feature = "azure")]
    pub(crate) azure_credential: Option<&'a AzureCredential>,
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
        // The engine's rules, asked as data so that each problem keeps its setting.
        let problems = crate::engine::backend_problems(&self.options, &backend);
        if !problems.is_empty() {
            return Err(problems.into_iter().map(|p| p.at(&path)).collect());
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
        // The engine's rules passed, so this is not expected to fail; its message is kept.
        .map_err(|error| vec![Problem::detail(path, error.message())])
    }
}
