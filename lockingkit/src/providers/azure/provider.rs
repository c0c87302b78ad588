//! The Azure Blob lease provider as a registry builds it (`provider = "azure_blob"`).

use super::{AzureBlobBackend, AzureBlobOptions};
use crate::config::{Problem, WholeNumbers};
use crate::engine::LockOptions;
use crate::registry::{HostResources, LockingBuilder, Provider};

/// One blob lease per key, in one container.
pub(crate) struct AzureBlob;

impl Provider for AzureBlob {
    const NAME: &'static str = "azure_blob";
    type Options = AzureBlobOptions;
    type Backend = AzureBlobBackend;
    const WHOLE_NUMBERS: &'static [WholeNumbers] = AzureBlobOptions::WHOLE_NUMBERS;

    fn problems(options: &AzureBlobOptions) -> Vec<Problem> {
        options.problems()
    }

    fn open(
        options: AzureBlobOptions,
        host: HostResources<'_>,
    ) -> Result<AzureBlobBackend, Vec<Problem>> {
        // The host's credential is for options that name a service_url; a connection string
        // carries its own.
        let credential = options
            .service_url
            .as_ref()
            .and(host.azure_credential.cloned());
        AzureBlobBackend::open(options, credential)
    }
}

impl LockingBuilder {
    /// Adds an Azure Blob lease provider; its options are checked when the registry is built.
    ///
    /// Options that name a `service_url` authenticate with the
    /// [`azure_credential`](Self::azure_credential) given to this builder.
    pub fn azure_blob(
        self,
        name: impl Into<String>,
        azure: AzureBlobOptions,
        options: LockOptions,
    ) -> Self {
        self.built_in::<AzureBlob>(name, azure, options)
    }
}
