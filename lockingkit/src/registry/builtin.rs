//! The providers a configuration file can name without registering anything: the one list of
//! built-in providers, and how one is built from its section or from options given in code.

use super::provider::Provider;
use super::section::ProviderSection;
use super::setup::{HostResources, ProviderResult, ProviderSetup};
use crate::backend::LockBackend;
use crate::config::Problem;
use crate::providers;

/// Every built-in provider, whether or not its feature is enabled; a disabled one explains
/// which feature it needs instead of being an unknown provider. Adding a provider adds its
/// line here (twice: built when its feature is on, explained when it is off).
pub(super) const BUILT_IN: &[BuiltIn] = &[
    BuiltIn::of::<providers::memory::InMemory>(),
    #[cfg(feature = "postgres")]
    BuiltIn::of::<providers::postgres::Postgres>(),
    #[cfg(not(feature = "postgres"))]
    BuiltIn::needs("postgres", "postgres"),
    #[cfg(feature = "mysql")]
    BuiltIn::of::<providers::mysql::Mysql>(),
    #[cfg(not(feature = "mysql"))]
    BuiltIn::needs("mysql", "mysql"),
    #[cfg(feature = "azure")]
    BuiltIn::of::<providers::azure::AzureBlob>(),
    #[cfg(not(feature = "azure"))]
    BuiltIn::needs("azure_blob", "azure"),
    #[cfg(feature = "etcd")]
    BuiltIn::of::<providers::etcd::Etcd>(),
    #[cfg(not(feature = "etcd"))]
    BuiltIn::needs("etcd", "etcd"),
    #[cfg(feature = "redis")]
    BuiltIn::of::<providers::redis::Redis>(),
    #[cfg(not(feature = "redis"))]
    BuiltIn::needs("redis", "redis"),
];

/// A built-in provider: its configuration name and how to build it from a section.
pub(super) struct BuiltIn {
    pub(super) name: &'static str,
    /// How to build it, or the cargo feature it needs when that is off.
    build: Result<fn(&ProviderSection, ProviderSetup<'_>) -> ProviderResult, &'static str>,
}

impl BuiltIn {
    /// A provider whose feature is enabled (or that needs none).
    const fn of<P: Provider>() -> Self {
        BuiltIn {
            name: P::NAME,
            build: Ok(from_section::<P>),
        }
    }

    /// A provider whose cargo `feature` is off.
    #[allow(dead_code)] // Unused when every provider's feature is on.
    const fn needs(name: &'static str, feature: &'static str) -> Self {
        BuiltIn {
            name,
            build: Err(feature),
        }
    }

    /// Builds the provider `section` describes.
    pub(super) fn build(
        &self,
        section: &ProviderSection,
        setup: ProviderSetup<'_>,
    ) -> ProviderResult {
        match self.build {
            Ok(build) => build(section, setup),
            Err(feature) => Err(vec![Problem::new(
                format!("{}.provider", section.path()),
                format!(
                    "is {}, which needs lockingkit's `{feature}` feature",
                    self.name
                ),
            )]),
        }
    }
}

/// Builds provider `P` from its section: binds its options, runs their checks and the engine's,
/// and reports every problem of both in one go.
fn from_section<P: Provider>(
    section: &ProviderSection,
    setup: ProviderSetup<'_>,
) -> ProviderResult {
    let (options, mut problems) = bind_checked::<P>(section);
    let path = section.path();
    if options.is_none() {
        if let Some(timing) = P::timing_without_options() {
            let rules = crate::engine::problems_with(&setup.options, timing, P::NAME);
            problems.extend(rules.into_iter().map(|problem| problem.at(path)));
        }
    }
    let backend = options.map(|options| open_at::<P>(options, setup.host, path));
    finish(backend, setup, problems)
}

/// Opens provider `P` from `options`, its problems placed in the section at `path`. What
/// [`LockingBuilder`](super::LockingBuilder) calls for options given in code.
pub(super) fn open_at<P: Provider>(
    options: P::Options,
    host: HostResources<'_>,
    path: &str,
) -> Result<P::Backend, Vec<Problem>> {
    P::open(options, host).map_err(|problems| problems.into_iter().map(|p| p.at(path)).collect())
}

/// Binds `P`'s options from the section and runs their own checks on whatever bound, so one
/// bad setting hides no other problem. Returns the options when they can build a backend
/// (everything parsed and passed its checks; unknown settings aside), and every problem.
fn bind_checked<P: Provider>(section: &ProviderSection) -> (Option<P::Options>, Vec<Problem>) {
    let bound = section.bind_recorded::<P::Options>(P::WHOLE_NUMBERS);
    let own = bound.checked(section.path(), P::problems);
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
