//! Building one provider from its configuration section: sort the settings, bind the engine
//! options the registry owns, find the provider the section names, and let it bind the rest.

use std::sync::Arc;

use serde_json::{Map, Value};

use super::bind::bind_section;
use super::builtin::BUILT_IN;
use super::lenient::canonical;
use super::probe::struct_fields;
use super::section::ProviderSection;
use super::setup::{HostResources, ProviderResult, ProviderSetup};
use crate::config::Problem;
use crate::engine::LockOptions;
use crate::lock::DistributedLock;

/// How a custom provider is built from its section, once the registry has bound the engine
/// options.
pub(super) type Factory =
    Arc<dyn Fn(&ProviderSection, ProviderSetup<'_>) -> ProviderResult + Send + Sync>;

/// A provider a section may name, registered in code with
/// [`custom_provider`](super::LockingBuilder::custom_provider).
pub(super) struct CustomProvider {
    /// The provider name sections write, matched ignoring case, `_` and `-`.
    pub(super) name: String,
    pub(super) factory: Factory,
}

/// A section's settings, sorted by who binds them.
struct SortedSettings {
    /// The `provider` setting.
    provider: Option<Value>,
    /// The engine options, bound by the registry.
    engine: Map<String, Value>,
    /// Everything else, for the provider to bind.
    own: Map<String, Value>,
}

impl SortedSettings {
    fn sort(settings: Map<String, Value>) -> Self {
        let engine_fields = struct_fields::<LockOptions>().unwrap_or(&[]);
        let mut sorted = SortedSettings {
            provider: None,
            engine: Map::new(),
            own: Map::new(),
        };
        for (key, value) in settings {
            let wanted = canonical(&key);
            if wanted == "provider" {
                sorted.provider = Some(value);
            } else if engine_fields.iter().any(|field| canonical(field) == wanted) {
                sorted.engine.insert(key, value);
            } else {
                sorted.own.insert(key, value);
            }
        }
        sorted
    }
}

/// Builds the provider of the section called `name`, adding every problem found to
/// `problems`. Returns the provider only when the section has no problem at all.
pub(super) fn build_section(
    name: &str,
    settings: Map<String, Value>,
    custom: &[CustomProvider],
    host: HostResources<'_>,
    problems: &mut Vec<Problem>,
) -> Option<DistributedLock> {
    // A check judges the options as bound, defaults included: a value it shows that the
    // section did not write is said to be the default, or the reader hunts for a setting
    // they never wrote.
    let written: Vec<String> = settings.keys().map(|key| canonical(key)).collect();
    let first = problems.len();
    let built = build_written(name, settings, custom, host, problems);
    for problem in problems.iter_mut().skip(first) {
        problem.mark_defaults(|setting| written.contains(&canonical(setting)));
    }
    built
}

/// [`build_section`], before the problems say which values are defaults.
fn build_written(
    name: &str,
    settings: Map<String, Value>,
    custom: &[CustomProvider],
    host: HostResources<'_>,
    problems: &mut Vec<Problem>,
) -> Option<DistributedLock> {
    let path = format!("Locking.{name}");
    let settings = SortedSettings::sort(settings);
    let (options, options_ok) = bind_engine_options(&path, &settings.engine, problems);
    let provider = match provider_name(&path, settings.provider, custom) {
        Ok(provider) => provider,
        Err(problem) => {
            problems.push(problem);
            return None;
        }
    };
    let section = ProviderSection::new(name.to_owned(), path.clone(), provider, settings.own);
    // When the engine options are bad the provider still checks its own settings, so the one
    // error lists both; what it builds is dropped.
    let setup = ProviderSetup {
        name,
        options,
        host,
    };
    let result = match build_provider(&section, setup, custom) {
        Ok(result) => result,
        Err(unknown) => {
            problems.push(unknown);
            return None;
        }
    };
    match result {
        Ok(lock) if options_ok => Some(lock),
        Ok(_) => None,
        Err(more) => {
            problems.extend(more);
            None
        }
    }
}

/// Builds the provider `section` names, built-in or custom, or returns the problem of a
/// name no provider has.
fn build_provider(
    section: &ProviderSection,
    setup: ProviderSetup<'_>,
    custom: &[CustomProvider],
) -> Result<ProviderResult, Problem> {
    let wanted = canonical(section.provider());
    if let Some(builtin) = BUILT_IN.iter().find(|b| canonical(b.name) == wanted) {
        return Ok(builtin.build(section, setup));
    }
    if let Some(custom) = custom.iter().find(|c| canonical(&c.name) == wanted) {
        return Ok((custom.factory)(section, setup));
    }
    Err(Problem::new(
        format!("{}.provider", section.path()),
        format!(
            "{} is not a known provider (one of: {})",
            section.provider(),
            known_providers(custom)
        ),
    ))
}

/// Binds the engine options of the section at `path`, adding their problems to `problems`.
///
/// Returns the options to build the provider with, and whether they bound without a problem.
/// When some are bad (and listed already), the provider is still built with a sound set that
/// keeps `renew_every` as written, so that the engine's check of the cadence against the
/// lease is not left for a second round.
fn bind_engine_options(
    path: &str,
    settings: &Map<String, Value>,
    problems: &mut Vec<Problem>,
) -> (LockOptions, bool) {
    let bound = bind_section::<LockOptions>(path, "shared", settings, &[]);
    let checked = bound.checked(path, LockOptions::problems);
    let ok = bound.problems.is_empty() && checked.is_empty();
    problems.extend(bound.problems);
    problems.extend(checked);
    let options = match bound.value {
        Some(options) if ok => options,
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
    (options, ok)
}

/// The provider a section names, or the problem of a missing or unusable name.
fn provider_name(
    path: &str,
    provider: Option<Value>,
    custom: &[CustomProvider],
) -> Result<String, Problem> {
    match provider {
        Some(Value::String(provider)) if !provider.trim().is_empty() => Ok(provider),
        Some(_) => Err(Problem::new(
            format!("{path}.provider"),
            format!(
                "must be a provider name (one of: {})",
                known_providers(custom)
            ),
        )),
        None => Err(Problem::new(
            format!("{path}.provider"),
            format!("is missing (one of: {})", known_providers(custom)),
        )),
    }
}

/// The provider names a section may write, built-in first.
fn known_providers(custom: &[CustomProvider]) -> String {
    BUILT_IN
        .iter()
        .map(|builtin| builtin.name)
        .chain(custom.iter().map(|custom| custom.name.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}
