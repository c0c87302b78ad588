//! Serde helpers shared by option structs: durations written as `"250ms"`, `"30s"`, `"2m"`.

use std::time::Duration;

/// Parses `"250ms"`, `"30s"`, `"1.5s"`, `"2m"` or `"1h"`; a bare number is milliseconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration such as 250ms, 30s or 2m"))?;
    let seconds = match unit.trim() {
        "" | "ms" => value / 1000.0,
        "s" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "unknown duration unit `{other}` (use ms, s, m or h)"
            ))
        }
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("`{text}` is out of range"))
}

/// Writes a duration in the form [`parse_duration`] reads.
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

    use serde::{de, Deserialize, Deserializer, Serializer};

    /// Serializes as `"30s"` or `"250ms"`.
    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&super::format_duration(*value))
    }

    /// Accepts `"30s"`-style strings and integers (milliseconds).
    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Millis(u64),
            Text(String),
        }
        match Raw::deserialize(deserializer)? {
            Raw::Millis(ms) => Ok(Duration::from_millis(ms)),
            Raw::Text(text) => super::parse_duration(&text).map_err(de::Error::custom),
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
        assert_eq!(parse_duration("75"), Ok(Duration::from_millis(75)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5 fortnights").is_err());
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
#[derive(Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(transparent)]
pub struct SecretString(String);

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
