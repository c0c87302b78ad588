//! What option structs share: durations written as `"250ms"`, `"30s"`, `"2m"`, secret strings,
//! and [`Problem`], the one way a configuration's problems are told.

use std::time::Duration;

mod problem;

pub use problem::Problem;
pub(crate) use problem::{into_error, misconfigured_at};

/// What a duration setting expects, for messages about one that did not parse.
pub(crate) const EXPECTED_DURATION: &str =
    "expected a duration with its unit, such as \"30s\" or \"250ms\" (units ms, s, m, h)";

/// What a negative duration setting is told: the sign is the mistake, not a missing unit.
pub(crate) const NEGATIVE_DURATION: &str =
    "must not be negative (expected a duration with its unit, such as \"30s\" or \"250ms\")";

/// The newtype name [`duration`] deserializes through, so the configuration binder can tell a
/// duration field from any other without reading error text.
pub(crate) const DURATION_NEWTYPE: &str = "lockingkit::config::Duration";

/// The newtype name [`SecretString`] deserializes through, so the binder knows which settings
/// to keep out of messages.
pub(crate) const SECRET_NEWTYPE: &str = "lockingkit::config::SecretString";

/// Parses `"250ms"`, `"30s"`, `"1.5s"`, `"2m"` or `"1h"`. A number without a unit is refused:
/// `QUERY_TIMEOUT=5` meant as seconds and read as milliseconds would fail every lock request
/// without a word. A negative one (`"-1s"`) is refused as negative.
///
/// Errors never repeat the text: a secret pasted into a duration setting must not reach a log.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.starts_with('-') {
        return Err(NEGATIVE_DURATION.to_owned());
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number.parse().map_err(|_| EXPECTED_DURATION.to_owned())?;
    let seconds = match unit.trim() {
        "" => return Err(format!("has no unit: {EXPECTED_DURATION}")),
        "ms" => value / 1000.0,
        "s" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(format!("unknown duration unit: {EXPECTED_DURATION}")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| "the duration is out of range".to_owned())
}

/// The whole numbers a setting takes, stated once: its option struct checks values against it,
/// and the configuration binder says the same when a value is no number at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WholeNumbers {
    pub(crate) setting: &'static str,
    pub(crate) min: u64,
    pub(crate) max: u64,
}

impl WholeNumbers {
    /// `a whole number from {min} to {max}`.
    pub(crate) fn describe(&self) -> String {
        format!("a whole number from {} to {}", self.min, self.max)
    }

    /// The problem with `value` of this setting, if it is out of range.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "azure", feature = "redis")),
        allow(dead_code)
    )]
    pub(crate) fn check(&self, value: u64) -> Option<Problem> {
        (!(self.min..=self.max).contains(&value))
            .then(|| Problem::new(self.setting, format!("must be {}", self.describe())))
    }

    /// The range stated for `setting` among `ranges`, if any.
    pub(crate) fn of<'a>(ranges: &'a [WholeNumbers], setting: &str) -> Option<&'a WholeNumbers> {
        ranges.iter().find(|range| range.setting == setting)
    }
}

/// The problem of a request timeout longer than a third of the lease, `None` when it fits: a
/// renewal that fails must leave time to be retried before the lease runs out. `timeout` is
/// the value of setting `timeout_setting`, `lease` that of `lease_setting`.
#[cfg_attr(
    not(any(feature = "azure", feature = "redis", feature = "etcd")),
    allow(dead_code)
)]
pub(crate) fn timeout_beyond_a_third_of_lease(
    timeout_setting: &str,
    timeout: Duration,
    lease_setting: &str,
    lease: Duration,
) -> Option<Problem> {
    (timeout > lease / 3).then(|| {
        Problem::new(
            timeout_setting,
            format!(
                "must be at most a third of {{{lease_setting}}}, so a failed renewal can be \
                 retried before the lease runs out"
            ),
        )
        .involving(lease_setting)
        .showing(timeout_setting, format!("{timeout:?}"))
        .showing(lease_setting, format!("{lease:?}"))
    })
}

/// Writes a duration in the form configuration sections read (`"30s"`, `"250ms"`).
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis.is_multiple_of(1000) {
        format!("{}s", millis / 1000)
    } else {
        format!("{millis}ms")
    }
}

/// `#[serde(with = "lockingkit::config::duration")]` for `Duration` fields.
pub mod duration {
    use std::time::Duration;

    use serde::{de, Deserializer, Serializer};

    /// Serializes as `"30s"` or `"250ms"`.
    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&super::format_duration(*value))
    }

    /// Accepts `"30s"`-style strings.
    ///
    /// Anything else (a number without a unit, a list) fails with a message that says what is
    /// expected and does not repeat the value.
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        deserializer.deserialize_newtype_struct(super::DURATION_NEWTYPE, DurationVisitor)
    }

    struct DurationVisitor;

    /// A number is refused whatever it is: which unit it meant is anyone's guess.
    fn no_unit<E: de::Error>() -> E {
        E::custom(format!("has no unit: {}", super::EXPECTED_DURATION))
    }

    impl<'de> de::Visitor<'de> for DurationVisitor {
        type Value = Duration;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&super::EXPECTED_DURATION["expected ".len()..])
        }

        fn visit_newtype_struct<D: Deserializer<'de>>(
            self,
            deserializer: D,
        ) -> Result<Duration, D::Error> {
            deserializer.deserialize_any(self)
        }

        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Duration, E> {
            Err(no_unit())
        }

        fn visit_i64<E: de::Error>(self, number: i64) -> Result<Duration, E> {
            match number < 0 {
                true => Err(E::custom(super::NEGATIVE_DURATION)),
                false => Err(no_unit()),
            }
        }

        fn visit_f64<E: de::Error>(self, number: f64) -> Result<Duration, E> {
            match number < 0.0 {
                true => Err(E::custom(super::NEGATIVE_DURATION)),
                false => Err(no_unit()),
            }
        }

        fn visit_str<E: de::Error>(self, text: &str) -> Result<Duration, E> {
            super::parse_duration(text).map_err(E::custom)
        }
    }
}

/// `#[serde(with = "lockingkit::config::option_duration")]` for `Option<Duration>` fields.
pub mod option_duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Serializes `None` as nothing and `Some` like [`super::duration`].
    pub fn serialize<S: Serializer>(
        value: &Option<Duration>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(d) => super::duration::serialize(d, serializer),
            None => serializer.serialize_none(),
        }
    }

    /// Accepts what [`super::duration`] accepts, or null.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Duration>, D::Error> {
        #[derive(Deserialize)]
        struct Wrap(#[serde(with = "super::duration")] Duration);
        Ok(Option::<Wrap>::deserialize(deserializer)?.map(|Wrap(d)| d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_in_every_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5 fortnights").is_err());
    }

    #[derive(Debug, serde::Deserialize)]
    struct Lease {
        #[serde(with = "duration")]
        lease: Duration,
    }

    fn lease(json: &str) -> Result<Duration, String> {
        serde_json::from_str::<Lease>(json)
            .map(|l| l.lease)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn a_number_without_a_unit_is_refused_whether_written_as_text_or_a_number() {
        // `QUERY_TIMEOUT=5` meant 5 s; read as 5 ms it would fail every lock request.
        for bare in ["5", "250", "1.5", "0"] {
            let error = parse_duration(bare).unwrap_err();
            assert!(error.contains("no unit"), "{bare}: {error}");
        }
        for number in ["5", "250", "1.5"] {
            let error = lease(&format!(r#"{{"lease": {number}}}"#)).unwrap_err();
            assert!(error.contains("no unit"), "{number}: {error}");
        }
    }

    #[test]
    fn a_negative_duration_is_refused_as_negative_with_or_without_its_unit() {
        for negative in ["-1s", " -250ms", "-5", "-0.5s"] {
            let error = parse_duration(negative).unwrap_err();
            assert!(
                error.starts_with("must not be negative"),
                "{negative}: {error}"
            );
            assert!(!error.contains("no unit"), "{negative}: {error}");
        }
        for number in ["-5", "-1.5"] {
            let error = lease(&format!(r#"{{"lease": {number}}}"#)).unwrap_err();
            assert!(error.contains("must not be negative"), "{number}: {error}");
        }
    }

    #[test]
    fn a_duration_that_does_not_parse_says_what_is_expected_without_the_value() {
        assert_eq!(
            lease(r#"{"lease": "1.5s"}"#),
            Ok(Duration::from_millis(1500))
        );
        for bad in [
            "-5",
            "1.5",
            r#""soon-hunter2""#,
            "[1]",
            r#""5 fortnights""#,
            r#""5""#,
        ] {
            let error = lease(&format!(r#"{{"lease": {bad}}}"#)).unwrap_err();
            assert!(
                error.contains(r#"a duration with its unit, such as "30s" or "250ms""#),
                "{bad}: {error}"
            );
            assert!(!error.contains("untagged"), "{bad}: {error}");
            assert!(!error.contains("hunter2"), "{bad}: {error}");
        }
    }

    #[test]
    fn formatted_durations_parse_back() {
        for d in [
            Duration::from_millis(50),
            Duration::from_secs(30),
            Duration::from_millis(1500),
        ] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d));
        }
    }
}

/// A secret setting (connection string, account key, password, SAS token).
///
/// Its `Debug` and `Display` print `[redacted]`, so option structs that hold one can derive
/// `Debug` without leaking it into logs or errors. Read it with [`SecretString::expose`].
#[derive(Clone, Default, PartialEq, Eq)]
pub struct SecretString(String);

impl<'de> serde::Deserialize<'de> for SecretString {
    /// Reads a string, through a named newtype so the configuration binder knows the setting
    /// is secret (formats without newtypes pass the string straight through).
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SecretVisitor;

        impl<'de> serde::de::Visitor<'de> for SecretVisitor {
            type Value = SecretString;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }

            fn visit_newtype_struct<D: serde::Deserializer<'de>>(
                self,
                deserializer: D,
            ) -> Result<SecretString, D::Error> {
                <String as serde::Deserialize>::deserialize(deserializer).map(SecretString)
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<SecretString, E> {
                Ok(SecretString(text.to_owned()))
            }

            fn visit_string<E: serde::de::Error>(self, text: String) -> Result<SecretString, E> {
                Ok(SecretString(text))
            }
        }

        deserializer.deserialize_newtype_struct(SECRET_NEWTYPE, SecretVisitor)
    }
}

impl SecretString {
    /// Wraps a secret.
    pub fn new(secret: impl Into<String>) -> Self {
        SecretString(secret.into())
    }

    /// The secret itself; keep it out of logs.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the secret is empty (or only whitespace).
    pub fn is_blank(&self) -> bool {
        self.0.trim().is_empty()
    }
}

impl From<String> for SecretString {
    fn from(secret: String) -> Self {
        SecretString(secret)
    }
}

impl From<&str> for SecretString {
    fn from(secret: &str) -> Self {
        SecretString(secret.to_owned())
    }
}

impl std::fmt::Debug for SecretString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl std::fmt::Display for SecretString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("[redacted]")
    }
}

impl serde::Serialize for SecretString {
    /// Serializes as `[redacted]`: options can be dumped for diagnostics without the secret.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str("[redacted]")
    }
}

#[cfg(test)]
mod secret_tests {
    use super::SecretString;

    #[test]
    fn secrets_never_format() {
        let secret = SecretString::new("Password=hunter2");
        assert_eq!(format!("{secret:?}"), "[redacted]");
        assert_eq!(secret.to_string(), "[redacted]");
        assert_eq!(secret.expose(), "Password=hunter2");
    }
}
