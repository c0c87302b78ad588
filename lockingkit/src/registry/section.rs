//! The `Locking` configuration section, and one provider's settings as its factory sees them.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, PoisonError};

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::bind::{bind_section, Bound, SecretSetting};
use super::lenient::canonical;
use crate::config::{self, Problem};
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
    /// What binding learnt about the settings; `None` until [`bind`](Self::bind) ran.
    binding: Mutex<Option<Binding>>,
}

/// What binding a section taught the registry, for reporting its factory's errors.
#[derive(Default)]
struct Binding {
    /// The secret and unknown settings seen by every bind.
    secrets: Vec<SecretSetting>,
    /// The problems of the last bind that failed, with the error it returned: a factory that
    /// passes that error on with `?` has its problems reported as the data they are.
    refused: Option<(Vec<Problem>, String)>,
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
            binding: Mutex::new(None),
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
    /// if one of the factory's own errors quotes such a value, the registry withholds that
    /// message and names the setting instead.
    pub fn bind<T: DeserializeOwned>(&self) -> Result<T, LockError> {
        self.bind_checked(|_: &T| Vec::new())
    }

    /// Binds like [`bind`](Self::bind), then runs `checks` (usually the options' own
    /// `problems` method) on what bound; their problems, about settings of this section, join
    /// the binding's in the one error, and so does nothing about a setting that did not parse.
    ///
    /// A factory that passes the error on with `?` has its problems reported by the registry
    /// as the data they are, next to every other section's.
    ///
    /// ```
    /// use lockingkit::config::Problem;
    /// use lockingkit::registry::ProviderSection;
    /// # use lockingkit::LockError;
    ///
    /// #[derive(serde::Deserialize)]
    /// struct Shelf {
    ///     slots: u32,
    /// }
    ///
    /// fn shelf(section: &ProviderSection) -> Result<Shelf, LockError> {
    ///     section.bind_checked(|shelf: &Shelf| match shelf.slots {
    ///         0 => vec![Problem::new("slots", "must be at least 1")],
    ///         _ => Vec::new(),
    ///     })
    /// }
    /// # let _ = shelf;
    /// ```
    pub fn bind_checked<T: DeserializeOwned>(
        &self,
        checks: impl FnOnce(&T) -> Vec<Problem>,
    ) -> Result<T, LockError> {
        let bound = self.bind_recorded::<T>(&[]);
        let mut problems = bound.checked(&self.path, checks);
        problems.splice(0..0, bound.problems);
        match bound.value {
            Some(value) if problems.is_empty() => Ok(value),
            _ => {
                let error = config::into_error(problems.clone());
                self.binding().get_or_insert_with(Binding::default).refused =
                    Some((problems, error.message().to_owned()));
                Err(error)
            }
        }
    }

    /// Binds like [`bind`](Self::bind), keeping the partial result and remembering secrets;
    /// `ranges` are those the options check (see `WholeNumbers`).
    pub(super) fn bind_recorded<T: DeserializeOwned>(
        &self,
        ranges: &[crate::config::WholeNumbers],
    ) -> Bound<T> {
        let bound = bind_section::<T>(&self.path, &self.provider, &self.settings, ranges);
        self.binding()
            .get_or_insert_with(Binding::default)
            .secrets
            .extend(bound.secrets.iter().cloned());
        bound
    }

    /// The problems an error of this section's factory reports.
    ///
    /// The error of a failed [`bind`](Self::bind) or [`bind_checked`](Self::bind_checked)
    /// passed on unchanged gives back its problems. Any other error is the factory's own text, which the registry does not
    /// control: a message that quotes the value of a secret setting is withheld whole, naming
    /// the setting instead. Secret settings are those [`bind`](Self::bind) learnt (secret
    /// fields and unknown settings), or every setting if the factory never bound its section,
    /// as nothing then says which are secret.
    pub(super) fn problems_of(&self, error: &LockError) -> Vec<Problem> {
        let binding = self.binding();
        if let Some(Binding {
            refused: Some((problems, message)),
            ..
        }) = &*binding
        {
            if error.kind() == ErrorKind::Misconfigured && error.message() == message {
                return problems.clone();
            }
        }
        // A message that names its section already is shown as written; any other is placed
        // in the section.
        let problem = match error.message() {
            message if message.starts_with(self.path.as_str()) => Problem::of_section(message),
            message => Problem::detail(&self.path, message),
        };
        let shown = problem.to_string();
        let every_setting;
        let secrets = match &*binding {
            Some(binding) => &binding.secrets,
            None => {
                every_setting = self.every_setting();
                &every_setting
            }
        };
        let quoted: Vec<&str> = secrets
            .iter()
            .filter(|secret| secret.is_quoted_in(&shown))
            .map(|secret| secret.key.as_str())
            .collect();
        if quoted.is_empty() {
            return vec![problem];
        }
        vec![Problem::detail(
            &self.path,
            format!(
                "the {} provider's message is withheld: it quotes the value of {}",
                self.provider,
                quoted.join(", ")
            ),
        )]
    }

    fn every_setting(&self) -> Vec<SecretSetting> {
        self.settings
            .iter()
            .map(|(key, value)| SecretSetting::new(key, value))
            .collect()
    }

    fn binding(&self) -> std::sync::MutexGuard<'_, Option<Binding>> {
        self.binding.lock().unwrap_or_else(PoisonError::into_inner)
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::registry::bind::tests::{settings, Account};

    fn section(value: Value) -> ProviderSection {
        ProviderSection::new(
            "Jobs".into(),
            "Locking.Jobs".into(),
            "demo".into(),
            settings(value),
        )
    }

    fn shown(problems: &[Problem]) -> Vec<String> {
        problems.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn a_custom_provider_section_binds_with_the_same_rules() {
        let section = section(json!({
            "ACCOUNT": "acct",
            "AccountKey": "hunter2-hunter2",
            "lease_duration": "20s",
            "max_connections": "4",
        }));
        let account: Account = section.bind().unwrap();
        assert_eq!(account.account, "acct");
        assert_eq!(account.account_key.expose(), "hunter2-hunter2");
        assert_eq!(account.max_connections, 4);
        assert!(!format!("{section:?}").contains("hunter2"));
    }

    #[test]
    fn a_failed_bind_passed_on_gives_back_its_problems_as_data() {
        let section = section(json!({"account": "acct", "max_connections": "many"}));
        let error = section.bind::<Account>().unwrap_err();
        assert!(
            error
                .message()
                .starts_with("invalid lock configuration: Locking.Jobs."),
            "{error}"
        );
        let problems = shown(&section.problems_of(&error));
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(problems.contains(&"Locking.Jobs.account_key is required".to_owned()));
    }

    #[test]
    fn only_a_factory_message_quoting_a_secret_setting_is_withheld() {
        let section = section(json!({
            "account": "acct",
            "account_key": "hunter2-key",
            "lease_duration": "20s",
            "max_connections": 4,
        }));
        let _: Account = section.bind().unwrap();
        let harmless = LockError::new(
            ErrorKind::Misconfigured,
            "Locking.Jobs.container: `job_locks` is not valid",
        );
        assert_eq!(
            shown(&section.problems_of(&harmless)),
            ["Locking.Jobs.container: `job_locks` is not valid"]
        );
        let quoting = LockError::new(ErrorKind::Misconfigured, "key `hunter2-key` refused");
        assert_eq!(
            shown(&section.problems_of(&quoting)),
            [
                "Locking.Jobs: the demo provider's message is withheld: it quotes the value of \
              account_key"
            ]
        );
    }

    #[test]
    fn a_section_never_bound_keeps_every_value_out() {
        let section = section(json!({"path": "/var/locks", "mode": "0600"}));
        let quoting = LockError::new(ErrorKind::Misconfigured, "cannot open /var/locks");
        let problems = shown(&section.problems_of(&quoting));
        assert_eq!(problems.len(), 1);
        assert!(!problems[0].contains("/var/locks"), "{problems:?}");
        assert!(problems[0].contains("the value of path"), "{problems:?}");
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
