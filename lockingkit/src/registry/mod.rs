//! Named providers, built once at startup from code or from the host's configuration.
//!
//! A [`Locking`] registry holds the provider called `Default` and any number of named ones
//! (`Jobs`, `Reports`, …), each a [`DistributedLock`]. Build it with [`Locking::builder`] or
//! from the `Locking` section of your configuration with [`Locking::from_config`]. Building
//! validates everything at once and fails with **one** [`ErrorKind::Misconfigured`] error that
//! lists every problem of every section, so a bad deployment stops at startup instead of on
//! the first lock it takes.
//!
//! ```
//! use lockingkit::registry::{Locking, LockingConfig};
//! use serde_json::json;
//!
//! # fn main() -> Result<(), lockingkit::LockError> {
//! let config = LockingConfig::new()
//!     .with_section("Default", json!({ "provider": "in_memory" }))
//!     .with_section("Jobs", json!({ "provider": "in_memory", "max_retry_delay": "2s" }));
//! let locking = Locking::from_config(config)?;
//! assert_eq!(locking.default_lock().name(), "Default");
//! assert_eq!(locking.get("Jobs").map(|jobs| jobs.provider()), Some("in_memory"));
//! # Ok(()) }
//! ```
//!
//! # Naming conventions
//! Sources disagree on case: environment variables are upper case and some configuration
//! crates lower-case every key. So:
//! - section names match ignoring ASCII case (`default`, `DEFAULT` and `Default` are all the
//!   `Default` provider, and `locking.get("jobs")` finds `Jobs`);
//! - provider names and setting names match ignoring ASCII case, `_` and `-`
//!   (`azure_blob` = `AzureBlob`, `connection_string` = `CONNECTION_STRING` = `ConnectionString`);
//! - a string binds a number or boolean setting when it parses as one, as environment
//!   variables always carry strings; an empty string unsets an optional setting.
//!
//! With a double underscore as the level separator, `LOCKING__JOBS__MAX_RETRY_DELAY=2s` is the
//! `max_retry_delay` of the `Jobs` provider.

mod builtin;
mod lenient;
mod section;

use std::fmt;
use std::sync::Arc;

use opentelemetry::metrics::Meter;
use serde_json::{Map, Value};

pub use builtin::MemoryOptions;
pub use section::{LockingConfig, ProviderSection};

use crate::backend::{LeaseTiming, LockBackend};
use crate::engine::LockOptions;
use crate::error::{ErrorKind, LockError};
use crate::lock::{DistributedLock, DEFAULT_NAME};
use crate::providers::memory::{MemoryBackend, MemoryStore};
use builtin::BUILT_IN;
use lenient::canonical;
use section::{bind_section, scrub};

/// Named lock providers, built once at startup.
///
/// Cheap to clone; every clone shares the same providers. See the [module docs](self) for
/// building one and for how names match.
#[derive(Clone)]
pub struct Locking {
    providers: Arc<[DistributedLock]>,
}

impl Locking {
    /// Starts a registry; add providers, then [`build`](LockingBuilder::build) it.
    pub fn builder() -> LockingBuilder {
        LockingBuilder::default()
    }

    /// Builds the registry from the `Locking` section of the host's configuration, with the
    /// built-in providers only. Use [`LockingBuilder::config`] to add custom providers too.
    pub fn from_config(config: LockingConfig) -> Result<Self, LockError> {
        Self::builder().config(config).build()
    }

    /// The provider called `Default`; every registry has one.
    ///
    /// Named `default_lock` rather than `default`, which would read like `Default::default`
    /// (a new, empty value) at the call site.
    pub fn default_lock(&self) -> &DistributedLock {
        // `build` puts Default first and refuses to build without it.
        &self.providers[0]
    }

    /// The provider called `name` (ignoring ASCII case), if there is one.
    pub fn get(&self, name: &str) -> Option<&DistributedLock> {
        self.providers
            .iter()
            .find(|lock| lock.name().eq_ignore_ascii_case(name))
    }

    /// The provider called `name`, or a `Misconfigured` error naming the providers there are.
    ///
    /// To fail at startup rather than here, list the names your application needs with
    /// [`LockingBuilder::required`].
    pub fn require(&self, name: &str) -> Result<&DistributedLock, LockError> {
        self.get(name).ok_or_else(|| {
            LockError::new(
                ErrorKind::Misconfigured,
                format!(
                    "no lock provider is named {name}; configured: {}",
                    self.names().collect::<Vec<_>>().join(", ")
                ),
            )
        })
    }

    /// The provider names, `Default` first.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.providers.iter().map(DistributedLock::name)
    }

    /// Every provider, `Default` first.
    pub fn iter(&self) -> impl Iterator<Item = &DistributedLock> {
        self.providers.iter()
    }

    /// How many providers there are (at least one: `Default`).
    pub fn len(&self) -> usize {
        self.providers.len()
    }

    /// Always `false`: a registry has at least the `Default` provider.
    pub fn is_empty(&self) -> bool {
        self.providers.is_empty()
    }

    /// Checks over the network what [`build`](LockingBuilder::build) cannot, since building
    /// stays synchronous and offline: for every Azure Blob provider, that the account exists,
    /// the credential is accepted and the container exists (see
    /// [`AzureBlobBackend::verify`](crate::providers::azure::AzureBlobBackend::verify)).
    /// Other providers are not contacted. Call it once at startup, after `build`.
    ///
    /// Fails with one [`ErrorKind::Misconfigured`] error listing every provider's problem,
    /// each prefixed with its section (such as "Locking.Jobs: the container \`job-locks\` does
    /// not exist …"); when nothing is misconfigured but a service did not answer, with
    /// [`ErrorKind::Unavailable`].
    pub async fn verify(&self) -> Result<(), LockError> {
        let mut misconfigured = Vec::new();
        let mut other: Option<LockError> = None;
        for lock in self.providers.iter() {
            let Err(error) = verify_provider(lock).await else {
                continue;
            };
            let problem = format!("Locking.{}: {}", lock.name(), error.message());
            if error.kind() == ErrorKind::Misconfigured {
                misconfigured.push(problem);
            } else if other.is_none() {
                other = Some(LockError::new(error.kind(), problem));
            }
        }
        match other {
            _ if !misconfigured.is_empty() => Err(LockError::misconfigured(misconfigured)),
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// The startup check of one provider, for those that have one.
#[allow(clippy::unused_async)]
async fn verify_provider(lock: &DistributedLock) -> Result<(), LockError> {
    #[cfg(feature = "azure")]
    if let Some(azure) = lock.backend::<crate::providers::azure::AzureBlobBackend>() {
        return azure.verify().await;
    }
    let _ = lock;
    Ok(())
}

impl fmt::Debug for Locking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.providers.iter().map(|p| (p.name(), p.provider())))
            .finish()
    }
}

/// What a custom provider's factory returns: a lock provider built from its section.
type Factory =
    Arc<dyn Fn(&ProviderSection, Assembly<'_>) -> Result<DistributedLock, LockError> + Send + Sync>;

/// A provider registered in code, waiting for `build`.
type Registration = Box<dyn FnOnce(Assembly<'_>) -> Result<DistributedLock, LockError> + Send>;

/// What every provider is built with besides its backend.
pub(crate) struct Assembly<'a> {
    name: &'a str,
    options: LockOptions,
    context: Context<'a>,
}

/// What the builder gives every provider alike.
#[derive(Clone, Copy)]
pub(crate) struct Context<'a> {
    meter: Option<&'a Meter>,
    /// The identity for Azure sections that name a `service_url`.
    #[cfg(feature = "azure")]
    pub(crate) azure_credential: Option<&'a AzureCredential>,
}

#[cfg(feature = "azure")]
type AzureCredential = Arc<dyn azure_core::credentials::TokenCredential>;

impl Assembly<'_> {
    /// Wraps `backend` in the engine, as every provider is.
    fn assemble<B: LockBackend>(self, backend: B) -> Result<DistributedLock, LockError> {
        // The engine would ignore it: a connection-held lock has no lease to renew, and a
        // setting that silently does nothing misleads whoever tunes it.
        if let (LeaseTiming::ConnectionHeld(_), Some(_)) =
            (backend.timing(), self.options.renew_every)
        {
            return Err(section::problem_list(vec![renew_every_does_not_apply(
                &format!("Locking.{}", self.name),
                backend.provider(),
            )]));
        }
        let builder = DistributedLock::builder(backend)
            .name(self.name)
            .options(self.options);
        match self.context.meter {
            Some(meter) => builder.meter(meter.clone()),
            None => builder,
        }
        .build()
    }
}

/// Builds a [`Locking`] registry: providers from code, from configuration, or both.
#[derive(Default)]
#[must_use]
pub struct LockingBuilder {
    registrations: Vec<(String, Registration)>,
    configs: Vec<LockingConfig>,
    custom: Vec<(String, Factory)>,
    required: Vec<String>,
    meter: Option<Meter>,
    #[cfg(feature = "azure")]
    azure_credential: Option<AzureCredential>,
}

impl LockingBuilder {
    /// Adds an in-memory provider with its own store, default options and 30 s leases.
    pub fn in_memory(self, name: impl Into<String>) -> Self {
        self.backend(
            name,
            MemoryBackend::new(MemoryStore::new()),
            LockOptions::default(),
        )
    }

    /// Adds a PostgreSQL provider; its options are checked when the registry is built.
    #[cfg(feature = "postgres")]
    pub fn postgres(
        self,
        name: impl Into<String>,
        postgres: crate::providers::postgres::PostgresOptions,
        options: LockOptions,
    ) -> Self {
        self.deferred(name, options, move |path, _| {
            let problems = postgres.problems(path);
            if !problems.is_empty() {
                return Err(section::problem_list(problems));
            }
            crate::providers::postgres::PostgresBackend::new(postgres)
                .map_err(|e| builtin::retarget(&e, "PostgresOptions", path))
        })
    }

    /// Adds an Azure Blob lease provider; its options are checked when the registry is built.
    ///
    /// Options that name a `service_url` authenticate with the
    /// [`azure_credential`](Self::azure_credential) given to this builder.
    #[cfg(feature = "azure")]
    pub fn azure_blob(
        self,
        name: impl Into<String>,
        azure: crate::providers::azure::AzureBlobOptions,
        options: LockOptions,
    ) -> Self {
        self.deferred(name, options, move |path, context| {
            use crate::providers::azure::AzureBlobBackend;
            let problems = azure.problems(path);
            if !problems.is_empty() {
                return Err(section::problem_list(problems));
            }
            match (&azure.service_url, context.azure_credential) {
                (Some(_), Some(credential)) => {
                    AzureBlobBackend::with_credential(azure, credential.clone())
                }
                _ => AzureBlobBackend::new(azure),
            }
            .map_err(|e| builtin::retarget(&e, "AzureBlobOptions", path))
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
    /// built, so its problems join everyone else's.
    #[cfg(any(feature = "postgres", feature = "azure"))]
    fn deferred<B: LockBackend>(
        mut self,
        name: impl Into<String>,
        options: LockOptions,
        make: impl FnOnce(&str, Context<'_>) -> Result<B, LockError> + Send + 'static,
    ) -> Self {
        let register: Registration = Box::new(move |assembly: Assembly<'_>| {
            let path = format!("Locking.{}", assembly.name);
            let mut problems = options.problems(&path);
            let backend =
                make(&path, assembly.context).map_err(|e| problems.push(e.message().to_owned()));
            match backend {
                Ok(backend) if problems.is_empty() => Assembly {
                    options,
                    ..assembly
                }
                .assemble(backend),
                _ => Err(section::problem_list(problems)),
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
        mut self,
        name: impl Into<String>,
        backend: B,
        options: LockOptions,
    ) -> Self {
        let name = name.into();
        let register: Registration = Box::new(move |assembly: Assembly<'_>| {
            let problems = options.problems(&format!("Locking.{}", assembly.name));
            if !problems.is_empty() {
                return Err(section::problem_list(problems));
            }
            Assembly {
                options,
                ..assembly
            }
            .assemble(backend)
        });
        self.registrations.push((name, register));
        self
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
        let factory: Factory = Arc::new(move |section: &ProviderSection, assembly| {
            assembly.assemble(factory(section)?)
        });
        self.custom.push((provider.into(), factory));
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

    /// Validates everything and builds the registry.
    ///
    /// Fails with one [`ErrorKind::Misconfigured`] error listing every problem: bad or unknown
    /// settings, unknown providers, a missing `Default`, names given twice, a missing
    /// [`required`](Self::required) provider, and whatever each provider's own checks find.
    /// Messages name settings, never their values.
    pub fn build(self) -> Result<Locking, LockError> {
        let LockingBuilder {
            registrations,
            configs,
            custom,
            required,
            meter,
            #[cfg(feature = "azure")]
            azure_credential,
        } = self;
        let context = Context {
            meter: meter.as_ref(),
            #[cfg(feature = "azure")]
            azure_credential: azure_credential.as_ref(),
        };
        let mut problems = Vec::new();
        let mut built: Vec<DistributedLock> = Vec::new();
        let mut seen: Vec<String> = Vec::new();

        for (provider, _) in &custom {
            let wanted = canonical(provider);
            if wanted.is_empty() {
                problems.push("a custom provider needs a non-empty name".to_owned());
            } else if BUILT_IN.iter().any(|b| canonical(b.name) == wanted) {
                problems.push(format!(
                    "the custom provider {provider} has the name of a built-in provider"
                ));
            }
        }

        for (name, register) in registrations {
            let Some(name) = registry_name(&name, &mut seen, &mut problems) else {
                continue;
            };
            let assembly = Assembly {
                name: &name,
                options: LockOptions::default(),
                context,
            };
            collect(
                register(assembly),
                &format!("Locking.{name}"),
                None,
                &mut built,
                &mut problems,
            );
        }

        let config = configs
            .into_iter()
            .reduce(LockingConfig::overlay)
            .unwrap_or_default();
        for (name, section) in config.into_sections() {
            let Some(name) = registry_name(&name, &mut seen, &mut problems) else {
                continue;
            };
            let path = format!("Locking.{name}");
            let Value::Object(settings) = section else {
                problems.push(format!("{path} must be a table of settings"));
                continue;
            };
            let result = build_section(&name, &path, settings, &custom, context, &mut problems);
            if let Some((result, secrets)) = result {
                collect(result, &path, Some(&secrets), &mut built, &mut problems);
            }
        }

        if !seen.iter().any(|name| name == DEFAULT_NAME) {
            problems.push(format!(
                "Locking.{DEFAULT_NAME} is missing: every registry needs a {DEFAULT_NAME} provider"
            ));
        }
        for name in &required {
            if !seen.iter().any(|seen| seen.eq_ignore_ascii_case(name)) {
                problems.push(format!(
                    "Locking.{name} is missing, and this application requires it"
                ));
            }
        }

        if !problems.is_empty() {
            // A problem found by two checks (a static one and the provider's) is listed once.
            let mut listed: Vec<String> = Vec::with_capacity(problems.len());
            for problem in problems {
                if !listed.contains(&problem) {
                    listed.push(problem);
                }
            }
            return Err(LockError::misconfigured(listed));
        }
        // Default first, so `Locking::default_lock` is an index, then in registration order.
        built.sort_by_key(|lock| lock.name() != DEFAULT_NAME);
        Ok(Locking {
            providers: built.into(),
        })
    }
}

impl fmt::Debug for LockingBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockingBuilder")
            .field(
                "registered",
                &self
                    .registrations
                    .iter()
                    .map(|(n, _)| n)
                    .collect::<Vec<_>>(),
            )
            .field("configs", &self.configs)
            .field(
                "custom_providers",
                &self.custom.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

/// The registration name for `name` (`Default` whatever its case), or `None` after noting why
/// it cannot be used.
fn registry_name(name: &str, seen: &mut Vec<String>, problems: &mut Vec<String>) -> Option<String> {
    let name = name.trim();
    if name.is_empty() {
        problems.push("a lock provider needs a non-empty name".to_owned());
        return None;
    }
    let written = name;
    let name = display_name(name);
    if let Some(earlier) = seen.iter().find(|s| s.eq_ignore_ascii_case(&name)) {
        problems.push(format!(
            "Locking.{written} is defined twice (as {earlier} too; names ignore case)"
        ));
        return None;
    }
    seen.push(name.clone());
    Some(name)
}

/// How a provider name is shown (in messages, `name()` and telemetry): a name written in one
/// case only, as environment variables deliver them (`REPORTS`, or `reports` once a
/// configuration crate has lower-cased it), is capitalised (`Reports`); a name with both
/// cases (`NightlyJobs`) is kept as written. So `default` is `Default`, like the docs spell it.
fn display_name(name: &str) -> String {
    let has_upper = name.chars().any(|c| c.is_ascii_uppercase());
    let has_lower = name.chars().any(|c| c.is_ascii_lowercase());
    if has_upper && has_lower {
        return name.to_owned();
    }
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return String::new();
    };
    let mut shown = first.to_ascii_uppercase().to_string();
    shown.push_str(&chars.as_str().to_ascii_lowercase());
    shown
}

/// The problem of a renewal cadence set on a provider whose locks are not leases.
fn renew_every_does_not_apply(path: &str, provider: &str) -> String {
    format!(
        "{path}.renew_every does not apply to the {provider} provider: its locks are held by a \
         connection, not renewed as leases (remove it; how often the connection is checked is \
         the provider's own setting, check_interval for postgres)"
    )
}

/// Keeps a built provider, or turns its error into problems prefixed with its section.
fn collect(
    result: Result<DistributedLock, LockError>,
    path: &str,
    secrets: Option<&[String]>,
    built: &mut Vec<DistributedLock>,
    problems: &mut Vec<String>,
) {
    match result {
        Ok(lock) => built.push(lock),
        Err(error) => {
            let message = match secrets {
                Some(secrets) => scrub(error.message(), secrets),
                None => error.message().to_owned(),
            };
            let message = message
                .strip_prefix("invalid lock configuration: ")
                .unwrap_or(&message);
            // Kept whole: a provider's own problems may contain "; " themselves.
            if message.starts_with(path) {
                problems.push(message.to_owned());
            } else {
                problems.push(format!("{path}: {message}"));
            }
        }
    }
}

/// Binds one configuration section: shared engine options, then the provider's own. Returns
/// the provider's result and the values to keep out of its errors, or `None` when the section
/// could not get as far as its provider.
fn build_section(
    name: &str,
    path: &str,
    settings: Map<String, Value>,
    custom: &[(String, Factory)],
    context: Context<'_>,
    problems: &mut Vec<String>,
) -> Option<(Result<DistributedLock, LockError>, Vec<String>)> {
    let shared_fields = lenient::struct_fields::<LockOptions>().unwrap_or(&[]);
    let mut provider = None;
    let mut shared = Map::new();
    let mut own = Map::new();
    for (key, value) in settings {
        let wanted = canonical(&key);
        if wanted == "provider" {
            provider = Some(value);
        } else if shared_fields.iter().any(|field| canonical(field) == wanted) {
            shared.insert(key, value);
        } else {
            own.insert(key, value);
        }
    }

    let before = problems.len();
    let bound = bind_section::<LockOptions>(path, "shared", &shared);
    problems.extend(bound.problems.iter().map(ToString::to_string));
    problems.extend(bound.checked(|options| options.problems(path)));
    let options_ok = problems.len() == before;
    // The options the provider is built with. When some are bad (and listed already), it is
    // still built with a sound set that keeps renew_every as written, so that the engine's
    // check of the cadence against the lease is not left for a second round.
    let options = match bound.value {
        Some(options) if options_ok => options,
        Some(options)
            if !bound.unparsed.contains(&"renew_every")
                && options.renew_every.is_none_or(|every| !every.is_zero()) =>
        {
            LockOptions {
                renew_every: options.renew_every,
                ..LockOptions::default()
            }
        }
        _ => LockOptions::default(),
    };

    let known = || {
        BUILT_IN
            .iter()
            .map(|b| b.name.to_owned())
            .chain(custom.iter().map(|(n, _)| n.clone()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let provider = match provider {
        Some(Value::String(provider)) if !provider.trim().is_empty() => provider,
        Some(_) => {
            problems.push(format!(
                "{path}.provider must be a provider name (one of: {})",
                known()
            ));
            return None;
        }
        None => {
            problems.push(format!("{path}.provider is missing (one of: {})", known()));
            return None;
        }
    };
    let wanted = canonical(&provider);
    // Known without building anything, so it is reported even when the section has other
    // problems (building the provider would find it too: duplicates are dropped).
    if wanted == "postgres" && options.renew_every.is_some() {
        problems.push(renew_every_does_not_apply(path, "postgres"));
    }
    let section = ProviderSection::new(name.to_owned(), path.to_owned(), provider.clone(), own);
    // When the shared options are bad the provider still checks its own settings, so the one
    // error lists both; what it builds is dropped.
    let assembly = Assembly {
        name,
        options,
        context,
    };
    let result = if let Some(builtin) = BUILT_IN.iter().find(|b| canonical(b.name) == wanted) {
        (builtin.build)(&section, assembly)
    } else if let Some((_, factory)) = custom.iter().find(|(n, _)| canonical(n) == wanted) {
        factory(&section, assembly)
    } else {
        problems.push(format!(
            "{path}.provider {provider} is not a known provider (one of: {})",
            known()
        ));
        return None;
    };
    let result = match result {
        Ok(_) if !options_ok => return None,
        other => other,
    };
    Some((result, section.secrets()))
}

#[cfg(test)]
mod tests;
