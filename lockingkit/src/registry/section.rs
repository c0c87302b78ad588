//! The `Locking` configuration section and the binding of one provider's settings.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, PoisonError};

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::lenient::{
    canonical, expected, missing_fields, struct_fields, BindError, Expected, Lenient,
};
use crate::error::{ErrorKind, LockError};

/// The `Locking` section of the host's configuration: one sub-section per named provider.
///
/// Each sub-section names its provider and carries that provider's options next to the engine
/// options every provider shares ([`LockOptions`](crate::LockOptions)):
///
/// ```toml
/// [Locking.Default]
/// provider = "postgres"
/// connection_string = "host=db user=app password=…"
///
/// [Locking.Jobs]
/// provider = "azure_blob"
/// container = "locks"
/// max_retry_delay = "2s"
/// ```
///
/// The same settings bind from environment variables such as
/// `LOCKING__DEFAULT__CONNECTION_STRING`. Because sources disagree on case, provider names and
/// setting names match ignoring ASCII case, `_` and `-`, and section names ignoring ASCII case
/// (see [`Locking::from_config`](crate::registry::Locking::from_config)).
///
/// `LockingConfig` deserializes from any self-describing format (TOML, JSON, YAML, the
/// `config` and `figment` crates) and checks nothing by itself: every check happens when the
/// registry is built, so all problems are reported together. Its `Debug` shows section names
/// and providers only, never a setting's value.
#[derive(Clone, Default, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct LockingConfig {
    sections: BTreeMap<String, Value>,
}

impl LockingConfig {
    /// An empty configuration.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the section called `name`, such as a `serde_json::json!` object.
    pub fn with_section(mut self, name: impl Into<String>, section: Value) -> Self {
        self.sections.insert(name.into(), section);
        self
    }

    /// Lays `overrides` over this configuration, setting by setting, as a layered source
    /// would: a later value wins.
    ///
    /// Unlike a generic layering, names match the way the registry reads them: sections
    /// ignoring ASCII case, settings ignoring ASCII case, `_` and `-`. That matters because
    /// configuration crates keep a file's keys as written (`[Locking.Default]`) but lower-case
    /// environment variables (`LOCKING__DEFAULT__LEASE_DURATION` becomes
    /// `default.lease_duration`), so the two would otherwise never meet. The earlier spelling
    /// of a name is kept.
    ///
    /// ```
    /// use lockingkit::LockingConfig;
    /// use serde_json::json;
    ///
    /// let file = LockingConfig::new()
    ///     .with_section("Default", json!({ "provider": "in_memory", "lease_duration": "30s" }));
    /// let env = LockingConfig::new().with_section("default", json!({ "LEASE_DURATION": "20s" }));
    /// let merged = file.overlay(env);
    /// assert_eq!(
    ///     merged.section("DEFAULT"),
    ///     Some(&json!({ "provider": "in_memory", "lease_duration": "20s" }))
    /// );
    /// ```
    pub fn overlay(mut self, overrides: LockingConfig) -> Self {
        for (name, section) in overrides.sections {
            let existing = self
                .sections
                .iter_mut()
                .find(|(own, _)| own.eq_ignore_ascii_case(&name));
            match existing {
                Some((_, current)) => overlay_value(current, section),
                None => {
                    self.sections.insert(name, section);
                }
            }
        }
        self
    }

    /// The section called `name` (ignoring ASCII case), as bound from the source.
    pub fn section(&self, name: &str) -> Option<&Value> {
        self.sections
            .iter()
            .find(|(own, _)| own.eq_ignore_ascii_case(name))
            .map(|(_, section)| section)
    }

    /// The section names, as written in the source.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.sections.keys().map(String::as_str)
    }

    /// Whether there are no sections.
    pub fn is_empty(&self) -> bool {
        self.sections.is_empty()
    }

    pub(super) fn into_sections(self) -> impl Iterator<Item = (String, Value)> {
        self.sections.into_iter()
    }
}

impl fmt::Debug for LockingConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (name, section) in &self.sections {
            let provider = section
                .as_object()
                .and_then(|settings| take_provider_ref(settings))
                .unwrap_or("?");
            map.entry(name, &format_args!("{provider}"));
        }
        map.finish()
    }
}

/// Lays `later` over `current`: tables merge by canonical key, anything else is replaced.
fn overlay_value(current: &mut Value, later: Value) {
    match (current, later) {
        (Value::Object(current), Value::Object(later)) => {
            for (key, value) in later {
                let wanted = canonical(&key);
                match current.iter_mut().find(|(own, _)| canonical(own) == wanted) {
                    Some((_, existing)) => overlay_value(existing, value),
                    None => {
                        current.insert(key, value);
                    }
                }
            }
        }
        (current, later) => *current = later,
    }
}

fn take_provider_ref(settings: &Map<String, Value>) -> Option<&str> {
    settings
        .iter()
        .find(|(key, _)| canonical(key) == "provider")
        .and_then(|(_, value)| value.as_str())
}

/// One provider's settings, handed to a custom provider's factory.
///
/// It holds the settings of the section other than `provider` and the shared engine options
/// (which the registry binds itself). Bind them to your options struct with
/// [`bind`](Self::bind), which applies the same case-insensitive matching, string-to-number
/// coercion and secret-safe error messages as the built-in providers get.
pub struct ProviderSection {
    name: String,
    path: String,
    provider: String,
    settings: Map<String, Value>,
    /// The values to keep out of messages, learnt by [`bind`](Self::bind); `None` until then.
    secrets: Mutex<Option<Vec<String>>>,
}

impl ProviderSection {
    pub(super) fn new(
        name: String,
        path: String,
        provider: String,
        settings: Map<String, Value>,
    ) -> Self {
        ProviderSection {
            name,
            path,
            provider,
            settings,
            secrets: Mutex::new(None),
        }
    }

    /// The registration name, such as `Jobs`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where the settings came from, such as `Locking.Jobs`; prefix problems with it.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The provider name as written in the configuration.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The raw provider settings, keys as the source wrote them.
    pub fn settings(&self) -> &Map<String, Value> {
        &self.settings
    }

    /// Binds the provider settings to `T`, listing every problem in one `Misconfigured` error.
    ///
    /// Field names match ignoring case, `_` and `-`; a setting no field of `T` takes is a
    /// problem (for types that deserialize as a plain struct), and so is each setting that does
    /// not parse, each saying what it expects. Error messages never repeat a setting's value.
    /// Fields of type [`SecretString`](crate::config::SecretString) are remembered as secret:
    /// if the factory's own errors quote their values, the registry removes them.
    pub fn bind<T: DeserializeOwned>(&self) -> Result<T, LockError> {
        let bound = self.bind_recorded::<T>();
        match bound.value {
            Some(value) if bound.problems.is_empty() => Ok(value),
            _ => Err(problem_list(
                bound.problems.iter().map(ToString::to_string).collect(),
            )),
        }
    }

    /// Binds like [`bind`](Self::bind), keeping the partial result and remembering secrets.
    pub(super) fn bind_recorded<T: DeserializeOwned>(&self) -> Bound<T> {
        let bound = bind_section::<T>(&self.path, &self.provider, &self.settings);
        let mut secrets = self.secrets.lock().unwrap_or_else(PoisonError::into_inner);
        secrets
            .get_or_insert_with(Vec::new)
            .extend(bound.secrets.iter().cloned());
        bound
    }

    /// The values to keep out of messages: those of secret and unknown settings once the
    /// section was bound, every string value if it never was (nothing is known about it).
    pub(super) fn secrets(&self) -> Vec<String> {
        let secrets = self.secrets.lock().unwrap_or_else(PoisonError::into_inner);
        match &*secrets {
            Some(secrets) => secrets.clone(),
            None => {
                let mut all = Vec::new();
                collect_strings(&Value::Object(self.settings.clone()), &mut all);
                all
            }
        }
    }
}

impl fmt::Debug for ProviderSection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProviderSection")
            .field("path", &self.path)
            .field("provider", &self.provider)
            .field("settings", &self.settings.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A `Misconfigured` error whose message is exactly the problems, for merging into the
/// registry's one error.
pub(super) fn problem_list(problems: Vec<String>) -> LockError {
    LockError::new(ErrorKind::Misconfigured, problems.join("; "))
}

/// One configuration problem: the setting (or section) it is about, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Problem {
    path: String,
    message: String,
    /// Whether the message is a detail after a colon (`path: expected …`) rather than the
    /// rest of a sentence (`path is required`).
    detail: bool,
}

impl Problem {
    /// `path` followed by the rest of a sentence: `Locking.Jobs.account is required`.
    pub(crate) fn sentence(path: String, rest: impl Into<String>) -> Self {
        Problem {
            path,
            message: rest.into(),
            detail: false,
        }
    }

    /// `path`, a colon and a detail: `Locking.Jobs.lease_duration: expected a duration …`.
    pub(crate) fn detail(path: String, detail: impl Into<String>) -> Self {
        Problem {
            path,
            message: detail.into(),
            detail: true,
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let separator = if self.detail { ": " } else { " " };
        write!(f, "{}{separator}{}", self.path, self.message)
    }
}

/// A section bound as far as it goes.
pub(crate) struct Bound<T> {
    /// `T` from every setting that parsed (defaults for the others), unless a required one
    /// is missing or bad.
    pub(crate) value: Option<T>,
    /// One problem per unknown, unparsable or missing setting.
    pub(crate) problems: Vec<Problem>,
    /// The fields whose setting did not parse: `value` holds their defaults, so checks that
    /// involve them would judge a value nobody wrote.
    pub(crate) unparsed: Vec<&'static str>,
    /// The values of secret and unknown settings, to keep out of messages.
    pub(crate) secrets: Vec<String>,
}

impl<T> Bound<T> {
    /// `checks` of the bound value, leaving out those about a setting that did not parse.
    pub(crate) fn checked(&self, checks: impl FnOnce(&T) -> Vec<String>) -> Vec<String> {
        let Some(value) = &self.value else {
            return Vec::new();
        };
        checks(value)
            .into_iter()
            .filter(|problem| !self.unparsed.iter().any(|field| problem.contains(field)))
            .collect()
    }
}

/// Binds `settings` to `T`: each setting on its own, so one bad setting hides nothing, then
/// `T` from the settings that parsed.
pub(crate) fn bind_section<T: DeserializeOwned>(
    path: &str,
    provider: &str,
    settings: &Map<String, Value>,
) -> Bound<T> {
    let mut bound = Bound {
        value: None,
        problems: Vec::new(),
        unparsed: Vec::new(),
        secrets: Vec::new(),
    };
    let Some(fields) = struct_fields::<T>() else {
        // Not a plain struct (a map, a flattened struct): nothing to go setting by setting.
        collect_strings(&Value::Object(settings.clone()), &mut bound.secrets);
        match T::deserialize(Lenient(Value::Object(settings.clone()))) {
            Ok(value) => bound.value = Some(value),
            Err(_) => bound.problems.push(Problem::sentence(
                path.to_owned(),
                format!("does not match the settings of the {provider} provider"),
            )),
        }
        return bound;
    };
    let mut present = Vec::new();
    let mut parsed = Map::new();
    for (key, value) in settings {
        let wanted = canonical(key);
        let Some(field) = fields.iter().find(|field| canonical(field) == wanted) else {
            let shared = struct_fields::<crate::engine::LockOptions>().unwrap_or(&[]);
            bound.problems.push(Problem::sentence(
                format!("{path}.{key}"),
                format!(
                    "is not a setting of the {provider} provider (its settings: {}, plus the \
                     engine options {})",
                    fields.join(", "),
                    shared.join(", ")
                ),
            ));
            // Perhaps a secret under a mistyped name: it is never shown.
            collect_strings(value, &mut bound.secrets);
            continue;
        };
        let expects = expected::<T>(field);
        if expects == Expected::Secret {
            collect_strings(value, &mut bound.secrets);
        }
        present.push(*field);
        let single = Map::from_iter([(key.clone(), value.clone())]);
        match T::deserialize(Lenient(Value::Object(single))) {
            // Alone, a setting misses the others; only its own value can be invalid.
            Err(BindError::Invalid(_)) => {
                bound
                    .problems
                    .push(Problem::detail(format!("{path}.{key}"), expects.describe()));
                bound.unparsed.push(field);
            }
            _ => {
                parsed.insert(key.clone(), value.clone());
            }
        }
    }
    for field in missing_fields::<T>(&present) {
        bound
            .problems
            .push(Problem::sentence(format!("{path}.{field}"), "is required"));
    }
    bound.value = T::deserialize(Lenient(Value::Object(parsed))).ok();
    bound
}

/// Removes each of `secrets` that a provider's own error quoted.
///
/// Only secret values are removed (see [`ProviderSection::secrets`]): a container or schema
/// name in a message is what the reader needs. serde quotes an unexpected string with `Debug`
/// (`string "…"`) and our parsers with backticks; a longer secret is also removed wherever it
/// appears bare.
pub(super) fn scrub(message: &str, secrets: &[String]) -> String {
    let mut message = message.to_owned();
    for text in secrets {
        let mut forms = vec![format!("{text:?}"), format!("`{text}`")];
        let trimmed = text.trim();
        forms.push(format!("`{trimmed}`"));
        forms.push(format!("{trimmed:?}"));
        if trimmed.len() >= 6 {
            forms.push(trimmed.to_owned());
        }
        for form in forms {
            if !form.is_empty() && message.contains(&form) {
                message = message.replace(&form, "[redacted]");
            }
        }
    }
    message
}

fn collect_strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(text) => out.push(text.clone()),
        Value::Array(items) => items.iter().for_each(|item| collect_strings(item, out)),
        Value::Object(map) => map.values().for_each(|item| collect_strings(item, out)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::config::SecretString;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Account {
        account: String,
        account_key: SecretString,
        #[serde(with = "crate::config::duration")]
        lease_duration: Duration,
        max_connections: u32,
    }

    fn settings(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            _ => unreachable!("test settings are objects"),
        }
    }

    fn problems_of(bound: &Bound<Account>) -> Vec<String> {
        bound.problems.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn every_bad_setting_is_listed_not_just_the_first() {
        let s = settings(json!({
            "account_key": 42,
            "lease_duration": "soon",
            "max_connections": "many",
            "colour": "blue",
        }));
        let bound = bind_section::<Account>("Locking.Jobs", "demo", &s);
        assert!(bound.value.is_none());
        let all = problems_of(&bound).join("\n");
        assert!(
            all.contains("Locking.Jobs.colour is not a setting of the demo provider"),
            "{all}"
        );
        assert!(
            all.contains("Locking.Jobs.account_key: expected a string"),
            "{all}"
        );
        assert!(
            all.contains(r#"Locking.Jobs.lease_duration: expected a duration such as "30s""#),
            "{all}"
        );
        assert!(
            all.contains(
                "Locking.Jobs.max_connections: expected a whole number from 0 to 4294967295"
            ),
            "{all}"
        );
        assert!(all.contains("Locking.Jobs.account is required"), "{all}");
        assert_eq!(bound.problems.len(), 5, "{all}");
        assert_eq!(
            bound.unparsed,
            ["account_key", "lease_duration", "max_connections"]
        );
    }

    #[test]
    fn what_parsed_still_binds_so_its_checks_can_run() {
        #[derive(Debug, Deserialize)]
        #[serde(default)]
        struct Pool {
            size: u32,
            #[serde(with = "crate::config::duration")]
            check: Duration,
        }
        impl Default for Pool {
            fn default() -> Self {
                Pool {
                    size: 4,
                    check: Duration::from_secs(5),
                }
            }
        }
        let s = settings(json!({"size": -1, "check": "0s"}));
        let bound = bind_section::<Pool>("Locking.Default", "demo", &s);
        let pool = bound.value.as_ref().expect("the parsed settings bind");
        assert_eq!(pool.check, Duration::ZERO);
        assert_eq!(pool.size, 4, "the unparsed one keeps its default");
        let checks = bound.checked(|pool| {
            vec![
                format!("check must be positive (was {:?})", pool.check),
                "size must not exceed 2 (a check of a default nobody wrote)".to_owned(),
            ]
        });
        assert_eq!(checks, ["check must be positive (was 0ns)"]);
    }

    #[test]
    fn nothing_a_user_wrote_is_repeated_in_a_binding_problem() {
        let secret = "AccountKey=c2VjcmV0LWtleQ==";
        let s = settings(json!({
            "account": "acct",
            "account_key": "k",
            "lease_duration": secret,
            "max_connections": secret,
        }));
        let bound = bind_section::<Account>("Locking.Jobs", "demo", &s);
        assert_eq!(bound.problems.len(), 2, "{:?}", bound.problems);
        for problem in problems_of(&bound) {
            assert!(!problem.contains(secret), "{problem}");
            assert!(!problem.contains("c2VjcmV0"), "{problem}");
        }
        assert_eq!(
            bound.secrets,
            ["k"],
            "only the secret field is kept out of messages"
        );
    }

    #[test]
    fn only_secret_values_are_scrubbed_from_a_providers_message() {
        let message = "Locking.Az.container: `job_locks` is not valid; key `hunter2-key` refused";
        assert_eq!(
            scrub(message, &["hunter2-key".to_owned()]),
            "Locking.Az.container: `job_locks` is not valid; key [redacted] refused"
        );
    }

    #[test]
    fn a_custom_provider_section_binds_with_the_same_rules() {
        let section = ProviderSection::new(
            "Jobs".into(),
            "Locking.Jobs".into(),
            "demo".into(),
            settings(json!({
                "ACCOUNT": "acct",
                "AccountKey": "hunter2-hunter2",
                "lease_duration": "20s",
                "max_connections": "4",
            })),
        );
        let account: Account = section.bind().unwrap();
        assert_eq!(account.account, "acct");
        assert_eq!(account.account_key.expose(), "hunter2-hunter2");
        assert_eq!(account.max_connections, 4);
        assert!(!format!("{section:?}").contains("hunter2"));
    }

    #[test]
    fn config_debug_names_sections_and_providers_only() {
        let config = LockingConfig::new().with_section(
            "Default",
            json!({"Provider": "postgres", "connection_string": "password=hunter2"}),
        );
        let shown = format!("{config:?}");
        assert_eq!(shown, r#"{"Default": postgres}"#);
    }
}
