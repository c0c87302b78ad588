//! The `Locking` configuration section and the binding of one provider's settings.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::lenient::{canonical, struct_fields, Lenient};
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
    /// problem (for types that deserialize as a plain struct). Error messages never repeat a
    /// setting's value, so a misplaced secret does not leak into logs.
    pub fn bind<T: DeserializeOwned>(&self) -> Result<T, LockError> {
        let mut problems = Vec::new();
        let bound = bind_settings::<T>(&self.path, &self.provider, &self.settings, &mut problems);
        match bound {
            Some(value) if problems.is_empty() => Ok(value),
            _ => Err(problem_list(problems)),
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

/// Binds `settings` to `T`, pushing one problem per bad setting; `None` when any failed.
pub(super) fn bind_settings<T: DeserializeOwned>(
    path: &str,
    provider: &str,
    settings: &Map<String, Value>,
    problems: &mut Vec<String>,
) -> Option<T> {
    let before = problems.len();
    if let Some(fields) = struct_fields::<T>() {
        for key in settings.keys() {
            let wanted = canonical(key);
            if !fields.iter().any(|field| canonical(field) == wanted) {
                let shared = struct_fields::<crate::engine::LockOptions>().unwrap_or(&[]);
                problems.push(format!(
                    "{path}.{key} is not a setting of the {provider} provider (its settings: {}, \
                     plus the engine options {})",
                    fields.join(", "),
                    shared.join(", ")
                ));
            }
        }
    }
    match T::deserialize(Lenient(Value::Object(settings.clone()))) {
        Ok(value) if problems.len() == before => Some(value),
        Ok(_) => None,
        Err(whole) => {
            let listed = problems.len();
            each_field_problem::<T>(path, settings, problems);
            if problems.len() == listed && listed == before {
                problems.push(format!("{path}: {}", scrub(&whole.to_string(), settings)));
            }
            None
        }
    }
}

/// Binds each setting on its own, so one bad field does not hide the next.
fn each_field_problem<T: DeserializeOwned>(
    path: &str,
    settings: &Map<String, Value>,
    problems: &mut Vec<String>,
) {
    let mut missing = Vec::new();
    for (key, value) in settings {
        let single = Map::from_iter([(key.clone(), value.clone())]);
        let Err(error) = T::deserialize(Lenient(Value::Object(single))) else {
            continue;
        };
        let message = error.to_string();
        match missing_field(&message) {
            // A single setting is always missing the others; only a field absent from the
            // whole section is a problem.
            Some(field) => missing.push(field.to_owned()),
            None if message.starts_with("unknown field") => {}
            None => problems.push(format!("{path}.{key}: {}", scrub(&message, settings))),
        }
    }
    missing.sort();
    missing.dedup();
    for field in missing {
        let wanted = canonical(&field);
        if !settings.keys().any(|key| canonical(key) == wanted) {
            problems.push(format!("{path}.{field} is required"));
        }
    }
}

fn missing_field(message: &str) -> Option<&str> {
    message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split('`').next())
}

/// Removes every string value of `settings` that a parser echoed into `message`.
///
/// serde quotes an unexpected string with `Debug` (`string "…"`) and our parsers with
/// backticks; a longer value is also removed wherever it appears bare.
pub(super) fn scrub(message: &str, settings: &Map<String, Value>) -> String {
    let mut message = message.to_owned();
    let mut strings = Vec::new();
    collect_strings(&Value::Object(settings.clone()), &mut strings);
    for text in strings {
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

    #[test]
    fn every_bad_setting_is_listed_not_just_the_first() {
        let s = settings(json!({
            "account_key": 42,
            "lease_duration": "soon",
            "max_connections": "many",
            "colour": "blue",
        }));
        let mut problems = Vec::new();
        let bound = bind_settings::<Account>("Locking.Jobs", "demo", &s, &mut problems);
        assert!(bound.is_none());
        let all = problems.join("\n");
        assert!(
            all.contains("Locking.Jobs.colour is not a setting of the demo provider"),
            "{all}"
        );
        assert!(all.contains("Locking.Jobs.account_key:"), "{all}");
        assert!(all.contains("Locking.Jobs.lease_duration:"), "{all}");
        assert!(all.contains("Locking.Jobs.max_connections:"), "{all}");
        assert!(all.contains("Locking.Jobs.account is required"), "{all}");
        assert_eq!(problems.len(), 5, "{all}");
    }

    #[test]
    fn a_value_echoed_by_a_parser_is_scrubbed() {
        let secret = "AccountKey=c2VjcmV0LWtleQ==";
        let s = settings(json!({
            "account": "acct",
            "account_key": "k",
            "lease_duration": secret,
            "max_connections": secret,
        }));
        let mut problems = Vec::new();
        bind_settings::<Account>("Locking.Jobs", "demo", &s, &mut problems);
        assert_eq!(problems.len(), 2, "{problems:?}");
        for problem in &problems {
            assert!(!problem.contains(secret), "{problem}");
            assert!(!problem.contains("c2VjcmV0"), "{problem}");
        }
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
