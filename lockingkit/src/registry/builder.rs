//! [`LockingBuilder`]: gathers providers from code and from configuration, then builds the
//! registry in one go.

use std::fmt;
use std::sync::Arc;

use opentelemetry::metrics::Meter;

use super::draft::Draft;
use super::from_config::{CustomProvider, Factory};
use super::provider::Provider;
use super::section::{LockingConfig, ProviderSection};
use super::setup::{HostResources, ProviderSetup, Registration};
use super::Locking;
use crate::backend::LockBackend;
use crate::config::Problem;
use crate::engine::LockOptions;
use crate::error::LockError;

/// Builds a [`Locking`] registry: providers from code, from configuration, or both.
#[derive(Default)]
#[must_use]
pub struct LockingBuilder {
    registrations: Vec<(String, Registration)>,
    configs: Vec<LockingConfig>,
    custom: Vec<CustomProvider>,
    required: Vec<String>,
    meter: Option<Meter>,
    key_digest: Option<crate::telemetry::KeyDigest>,
    #[cfg(feature = "azure")]
    azure_credential: Option<super::setup::AzureCredential>,
}

impl LockingBuilder {
    /// Adds built-in provider `P` with its own `options` and the engine's; both are checked
    /// when the registry is built. Each provider's public method (`in_memory`, `postgres`,
    /// `azure_blob`, `etcd`, `redis`) is written beside the provider and calls this.
    pub(crate) fn built_in<P: Provider>(
        self,
        name: impl Into<String>,
        own: P::Options,
        options: LockOptions,
    ) -> Self {
        self.deferred(name, options, move |path, host| {
            super::builtin::open_at::<P>(own, host, path)
        })
    }

    /// The Microsoft Entra identity (for example a managed identity from `azure_identity`) of
    /// every Azure Blob provider whose options name a `service_url` instead of a connection
    /// string, whether added in code or from configuration.
    #[cfg(feature = "azure")]
    pub fn azure_credential(
        mut self,
        credential: Arc<dyn azure_core::credentials::TokenCredential>,
    ) -> Self {
        self.azure_credential = Some(credential);
        self
    }

    /// Registers a provider whose backend is made, and checked, only when the registry is
    /// built, so its problems join everyone else's. `make` gets the provider's section path.
    fn deferred<B: LockBackend>(
        mut self,
        name: impl Into<String>,
        options: LockOptions,
        make: impl FnOnce(&str, HostResources<'_>) -> Result<B, Vec<Problem>> + Send + 'static,
    ) -> Self {
        let register: Registration = Box::new(move |setup: ProviderSetup<'_>| {
            let path = setup.path();
            let mut problems: Vec<Problem> = options
                .problems()
                .into_iter()
                .map(|p| p.at(&path))
                .collect();
            match make(&path, setup.host) {
                Ok(backend) if problems.is_empty() => {
                    ProviderSetup { options, ..setup }.assemble(backend)
                }
                Ok(_) => Err(problems),
                Err(more) => {
                    problems.extend(more);
                    Err(problems)
                }
            }
        });
        self.registrations.push((name.into(), register));
        self
    }

    /// Adds a provider on `backend`, built-in or your own, with engine `options`.
    ///
    /// It gets waiting, renewal, loss detection, release, results and telemetry exactly like
    /// the built-in providers. The options are validated when the registry is built.
    pub fn backend<B: LockBackend>(
        self,
        name: impl Into<String>,
        backend: B,
        options: LockOptions,
    ) -> Self {
        self.deferred(name, options, move |_, _| Ok(backend))
    }

    /// Adds every section of `config` (see [`LockingConfig`]).
    ///
    /// Call it once per source, lowest precedence first (a file, then environment variables):
    /// each later source is laid over the earlier ones with [`LockingConfig::overlay`], setting
    /// by setting and ignoring case, so `LOCKING__DEFAULT__LEASE_DURATION` overrides the
    /// `lease_duration` of a file's `[Locking.Default]`.
    pub fn config(mut self, config: LockingConfig) -> Self {
        self.configs.push(config);
        self
    }

    /// Lets configuration sections name `provider` (matched ignoring case, `_` and `-`).
    ///
    /// When a section says `provider = "<provider>"`, the registry binds the shared engine
    /// options itself and calls `factory` with the rest of the section, which typically binds
    /// its own options struct with [`ProviderSection::bind`] and opens the backend. A factory
    /// should check everything it can (paths, credentials' shape, reachable files) and return
    /// a `Misconfigured` error, so the problem is reported at startup with all the others.
    ///
    /// ```
    /// use lockingkit::registry::{Locking, LockingConfig};
    /// use lockingkit::MemoryBackend;
    ///
    /// #[derive(serde::Deserialize)]
    /// struct ShardOptions { shards: u32 }
    ///
    /// # fn main() -> Result<(), lockingkit::LockError> {
    /// let config = LockingConfig::new()
    ///     .with_section("Default", serde_json::json!({ "provider": "sharded", "shards": "4" }));
    /// let locking = Locking::builder()
    ///     .custom_provider("sharded", |section| {
    ///         let options: ShardOptions = section.bind()?;
    ///         assert_eq!(options.shards, 4);
    ///         Ok(MemoryBackend::new(Default::default()))
    ///     })
    ///     .config(config)
    ///     .build()?;
    /// assert_eq!(locking.default_lock().provider(), "in_memory");
    /// # Ok(()) }
    /// ```
    pub fn custom_provider<B, F>(mut self, provider: impl Into<String>, factory: F) -> Self
    where
        B: LockBackend,
        F: Fn(&ProviderSection) -> Result<B, LockError> + Send + Sync + 'static,
    {
        let factory: Factory = Arc::new(move |section: &ProviderSection, setup| {
            let backend = factory(section).map_err(|error| section.problems_of(&error))?;
            setup.assemble(backend)
        });
        self.custom.push(CustomProvider {
            name: provider.into(),
            factory,
        });
        self
    }

    /// Names a provider the application needs, so its absence fails the build instead of a
    /// later [`Locking::require`].
    pub fn required(mut self, name: impl Into<String>) -> Self {
        self.required.push(name.into());
        self
    }

    /// The meter every provider records on, instead of the global `lockingkit` meter.
    pub fn meter(mut self, meter: Meter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// Records a keyed digest of each lock's key on every provider's spans and loss log lines
    /// (see [`DistributedLockBuilder::key_digests`](crate::DistributedLockBuilder::key_digests)).
    /// Off unless set.
    pub fn key_digests(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.key_digest = Some(crate::telemetry::KeyDigest::new(secret.as_ref()));
        self
    }

    /// Validates everything and builds the registry.
    ///
    /// Fails with one [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured) error
    /// listing every problem: bad or unknown settings, unknown providers, a missing `Default`,
    /// names given twice, a missing [`required`](Self::required) provider, and whatever each
    /// provider's own checks find. Messages name settings, never their values.
    pub fn build(self) -> Result<Locking, LockError> {
        let LockingBuilder {
            registrations,
            configs,
            custom,
            required,
            meter,
            key_digest,
            #[cfg(feature = "azure")]
            azure_credential,
        } = self;
        let mut draft = Draft::new(HostResources {
            meter: meter.as_ref(),
            key_digest: key_digest.as_ref(),
            #[cfg(feature = "azure")]
            azure_credential: azure_credential.as_ref(),
        });
        draft.check_custom_providers(&custom);
        for (name, register) in registrations {
            draft.add_registered(&name, register);
        }
        let config = configs.into_iter().reduce(LockingConfig::overlay);
        for (name, section) in config.unwrap_or_default().into_sections() {
            draft.add_section(&name, section, &custom);
        }
        draft.check_present(&required);
        draft.finish()
    }
}

impl fmt::Debug for LockingBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let registered: Vec<&String> = self.registrations.iter().map(|(n, _)| n).collect();
        let custom: Vec<&String> = self.custom.iter().map(|c| &c.name).collect();
        f.debug_struct("LockingBuilder")
            .field("registered", &registered)
            .field("configs", &self.configs)
            .field("custom_providers", &custom)
            .finish_non_exhaustive()
    }
}
