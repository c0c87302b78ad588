//! Binding one section's settings to an options struct, setting by setting.
//!
//! Each setting is bound on its own, so one bad setting hides nothing; the struct is then bound
//! from the settings that parsed. Problems are worded from what the field expects
//! ([`Expected`]), never from a parser's text, so a value never reaches a message. The binder
//! also learns which settings are secret (fields of type
//! [`SecretString`](crate::config::SecretString), and settings no field takes, which may be a
//! secret under a mistyped name), so that the registry can keep their values out of messages
//! written by code it does not control.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::config::WholeNumbers;

use super::lenient::{canonical, BindError, Lenient};
use super::probe::{expected, missing_fields, struct_fields, Expected};
use crate::config::Problem;
use crate::engine::LockOptions;

/// A setting whose value must never be shown: a secret field, or a setting no field takes.
///
/// No `Debug`: it holds the value.
#[derive(Clone)]
pub(crate) struct SecretSetting {
    /// The setting's name as the source wrote it.
    pub(crate) key: String,
    /// Every string in its value (a table or list may hold several).
    values: Vec<String>,
}

impl SecretSetting {
    pub(crate) fn new(key: &str, value: &Value) -> Self {
        let mut values = Vec::new();
        collect_strings(value, &mut values);
        SecretSetting {
            key: key.to_owned(),
            values,
        }
    }

    /// Whether `text` quotes this setting's value.
    pub(crate) fn is_quoted_in(&self, text: &str) -> bool {
        self.values
            .iter()
            .map(|value| value.trim())
            .any(|value| !value.is_empty() && text.contains(value))
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
    /// The secret and unknown settings, whose values stay out of messages.
    pub(crate) secrets: Vec<SecretSetting>,
}

impl<T> Bound<T> {
    /// `checks` of the bound value, placed in `section`, leaving out those about a setting
    /// that did not parse.
    pub(crate) fn checked(
        &self,
        section: &str,
        checks: impl FnOnce(&T) -> Vec<Problem>,
    ) -> Vec<Problem> {
        let Some(value) = &self.value else {
            return Vec::new();
        };
        checks(value)
            .into_iter()
            .filter(|problem| !self.unparsed.iter().any(|field| problem.is_about(field)))
            .map(|problem| problem.at(section))
            .collect()
    }
}

/// Binds `settings` to `T`: each setting on its own, so one bad setting hides nothing, then
/// `T` from the settings that parsed. `path` is the section (`Locking.Jobs`), `provider` its
/// provider name, for messages.
pub(crate) fn bind_section<T: DeserializeOwned>(
    path: &str,
    provider: &str,
    settings: &Map<String, Value>,
    ranges: &[WholeNumbers],
) -> Bound<T> {
    let mut bound = Bound {
        value: None,
        problems: Vec::new(),
        unparsed: Vec::new(),
        secrets: Vec::new(),
    };
    let Some(fields) = struct_fields::<T>() else {
        bind_whole(path, provider, settings, &mut bound);
        return bound;
    };
    let mut present = Vec::new();
    let mut parsed = Map::new();
    for (key, value) in settings {
        let wanted = canonical(key);
        let Some(field) = fields.iter().find(|field| canonical(field) == wanted) else {
            bound
                .problems
                .push(unknown_setting(path, provider, key, fields));
            // Perhaps a secret under a mistyped name: it is never shown.
            bound.secrets.push(SecretSetting::new(key, value));
            continue;
        };
        let expects = expected::<T>(field);
        if expects == Expected::Secret {
            bound.secrets.push(SecretSetting::new(key, value));
        }
        present.push(*field);
        if binds_alone::<T>(key, value) {
            parsed.insert(key.clone(), value.clone());
        } else {
            // Worded from the field's type (and the range its options check, so that both
            // messages state the same one): the parser's own message may quote the value.
            let at = format!("{path}.{key}");
            let problem = match WholeNumbers::of(ranges, field) {
                Some(range) => Problem::detail(at, format!("expected {}", range.describe())),
                None => expects.problem(at, value),
            };
            bound.problems.push(problem);
            bound.unparsed.push(field);
        }
    }
    for field in missing_fields::<T>(&present) {
        bound
            .problems
            .push(Problem::new(format!("{path}.{field}"), "is required"));
    }
    bound.value = T::deserialize(Lenient(Value::Object(parsed))).ok();
    bound
}

/// Binds a `T` that is not a plain struct (a map, a flattened struct) in one go: there is no
/// field list to go setting by setting, nor to tell secrets from the rest, so every setting
/// is treated as secret.
fn bind_whole<T: DeserializeOwned>(
    path: &str,
    provider: &str,
    settings: &Map<String, Value>,
    bound: &mut Bound<T>,
) {
    bound.secrets.extend(
        settings
            .iter()
            .map(|(key, value)| SecretSetting::new(key, value)),
    );
    match T::deserialize(Lenient(Value::Object(settings.clone()))) {
        Ok(value) => bound.value = Some(value),
        Err(_) => bound.problems.push(Problem::new(
            path,
            format!("does not match the settings of the {provider} provider"),
        )),
    }
}

/// Whether the setting `key` binds a `T` on its own. Alone, a setting misses the others, so
/// only an invalid value of its own counts as failing.
fn binds_alone<T: DeserializeOwned>(key: &str, value: &Value) -> bool {
    let single = Map::from_iter([(key.to_owned(), value.clone())]);
    !matches!(
        T::deserialize(Lenient(Value::Object(single))),
        Err(BindError::Invalid(_))
    )
}

/// The problem of a setting no field of the options takes, listing those that exist.
fn unknown_setting(path: &str, provider: &str, key: &str, fields: &[&str]) -> Problem {
    let shared = struct_fields::<LockOptions>().unwrap_or(&[]);
    Problem::new(
        format!("{path}.{key}"),
        format!(
            "is not a setting of the {provider} provider (its settings: {}, plus the engine \
             options {})",
            fields.join(", "),
            shared.join(", ")
        ),
    )
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
pub(super) mod tests {
    use std::time::Duration;

    use serde::Deserialize;
    use serde_json::json;

    use super::*;
    use crate::config::SecretString;

    /// Settings with a secret, a duration and a number, for the binding tests here and in
    /// `section.rs`.
    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    pub(in crate::registry) struct Account {
        pub(in crate::registry) account: String,
        pub(in crate::registry) account_key: SecretString,
        #[serde(with = "crate::config::duration")]
        pub(in crate::registry) lease_duration: Duration,
        pub(in crate::registry) max_connections: u32,
    }

    pub(in crate::registry) fn settings(value: Value) -> Map<String, Value> {
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
        let bound = bind_section::<Account>("Locking.Jobs", "demo", &s, &[]);
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
            all.contains(
                r#"Locking.Jobs.lease_duration: expected a duration with its unit, such as "30s""#
            ),
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
    fn a_negative_duration_is_refused_as_negative_not_as_one_without_a_unit() {
        for negative in [json!("-1s"), json!(" -250ms"), json!(-5)] {
            let s = settings(
                json!({"account": "a", "account_key": "k", "max_connections": 1,
                                     "lease_duration": negative.clone()}),
            );
            let bound = bind_section::<Account>("Locking.Jobs", "demo", &s, &[]);
            let all = problems_of(&bound).join("\n");
            assert_eq!(
                all,
                r#"Locking.Jobs.lease_duration must not be negative (expected a duration with its unit, such as "30s" or "250ms")"#,
                "{negative}"
            );
        }
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
        let bound = bind_section::<Pool>("Locking.Default", "demo", &s, &[]);
        let pool = bound.value.as_ref().expect("the parsed settings bind");
        assert_eq!(pool.check, Duration::ZERO);
        assert_eq!(pool.size, 4, "the unparsed one keeps its default");
        let checks = bound.checked("Locking.Default", |pool| {
            vec![
                Problem::new("check", format!("must be positive (was {:?})", pool.check)),
                Problem::new(
                    "size",
                    "must not exceed 2 (a check of a default nobody wrote)",
                ),
                Problem::new("check", "must be shorter than a tenth of size").involving("size"),
            ]
        });
        let checks: Vec<String> = checks.iter().map(ToString::to_string).collect();
        assert_eq!(checks, ["Locking.Default.check must be positive (was 0ns)"]);
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
        let bound = bind_section::<Account>("Locking.Jobs", "demo", &s, &[]);
        assert_eq!(bound.problems.len(), 2, "{:?}", bound.problems);
        for problem in problems_of(&bound) {
            assert!(!problem.contains(secret), "{problem}");
            assert!(!problem.contains("c2VjcmV0"), "{problem}");
        }
        let secrets: Vec<(&str, &[String])> = bound
            .secrets
            .iter()
            .map(|secret| (secret.key.as_str(), secret.values.as_slice()))
            .collect();
        assert_eq!(
            secrets,
            [("account_key", &["k".to_owned()][..])],
            "only the secret field is kept out of messages"
        );
    }

    #[test]
    fn a_secret_setting_knows_when_a_message_quotes_it() {
        let secret = SecretSetting::new("token", &json!({"inner": [" hunter2-key "]}));
        assert!(secret.is_quoted_in("key `hunter2-key` refused"));
        assert!(!secret.is_quoted_in("Locking.Az.container: `job_locks` is not valid"));
        assert!(!SecretSetting::new("token", &json!("  ")).is_quoted_in("any text"));
    }
}
