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

mod bind;
mod builder;
mod builtin;
mod draft;
mod from_config;
mod lenient;
mod probe;
mod provider;
mod section;
mod setup;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

pub use builder::LockingBuilder;
pub(crate) use provider::Provider;
pub(crate) use setup::HostResources;

pub use section::{LockingConfig, ProviderSection};

use crate::config::{self, Problem};
use crate::error::{ErrorKind, LockError};
use crate::lock::DistributedLock;

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
            LockError::misconfigured([format!(
                "no lock provider is named {name}; configured: {}",
                self.names().collect::<Vec<_>>().join(", ")
            )])
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
    /// stays synchronous and offline: for every provider, its
    /// [`DistributedLock::verify`] — for PostgreSQL that the server answers, accepts the
    /// credentials and has (or lets us create) the fencing objects; for Azure Blob that the
    /// account exists, the credential is accepted and the container exists. Call it once at
    /// startup, after `build`.
    ///
    /// Fails with one [`ErrorKind::Misconfigured`] error listing every provider's problem,
    /// each prefixed with its section (such as "Locking.Jobs: the container \`job-locks\` does
    /// not exist …"); when nothing is misconfigured but a service did not answer, with
    /// [`ErrorKind::Unavailable`].
    pub async fn verify(&self) -> Result<(), LockError> {
        let mut misconfigured = Vec::new();
        let mut other: Option<LockError> = None;
        for lock in self.providers.iter() {
            let Err(error) = lock.verify().await else {
                continue;
            };
            let problem = Problem::detail(format!("Locking.{}", lock.name()), error.message());
            if error.kind() == ErrorKind::Misconfigured {
                misconfigured.push(problem);
            } else if other.is_none() {
                other = Some(LockError::new(error.kind(), problem.to_string()));
            }
        }
        match other {
            _ if !misconfigured.is_empty() => Err(config::into_error(misconfigured)),
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Shuts every provider down (see [`DistributedLock::shutdown`]), all within `timeout`:
    /// new acquires are refused, every lock is given up, and the backends' connections close.
    /// Call it as the process stops, after the server has drained its requests (with axum,
    /// after `axum::serve(…).with_graceful_shutdown(…)` returns; docs/http.md shows it whole):
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), lockingkit::LockError> {
    /// use lockingkit::{LockOptions, Locking, MemoryBackend, MemoryStore};
    ///
    /// let store = MemoryStore::new();
    /// let backend = MemoryBackend::new(store);
    /// let locking = Locking::builder()
    ///     .backend("Default", backend, LockOptions::default())
    ///     .build()?;
    /// // … serve until SIGTERM, then:
    /// locking.shutdown(std::time::Duration::from_secs(5)).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// Fails with the first provider's error if any did not finish in time (the others are
    /// shut down all the same).
    pub async fn shutdown(&self, timeout: Duration) -> Result<(), LockError> {
        let deadline = crate::clock::in_(timeout);
        let mut first = None;
        for lock in self.providers.iter() {
            let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
            if let (Err(error), None) = (lock.shutdown(remaining).await, &first) {
                first = Some(error);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl fmt::Debug for Locking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.providers.iter().map(|p| (p.name(), p.provider())))
            .finish()
    }
}

#[cfg(test)]
mod tests;
