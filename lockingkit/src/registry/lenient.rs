//! Binding a configuration section the way hosts write it.
//!
//! Configuration reaches us through whatever source the host uses, and sources disagree:
//! environment variables are always strings and their names arrive upper- or lower-cased, a
//! TOML file may say `ConnectionString` where the option struct says `connection_string`. The
//! [`Lenient`] deserializer smooths exactly these differences and nothing else:
//!
//! - a struct's field names match ignoring ASCII case, `_` and `-`
//!   (`CONNECTION_STRING`, `connectionString` and `connection-string` all bind
//!   `connection_string`);
//! - a string binds a number or a boolean field when it parses as one (`"16"`, `"true"`);
//! - an empty string binds `None` for an optional field (an empty environment variable
//!   unsets a setting rather than failing to parse);
//! - a list field binds, besides a list, one string of items separated by commas
//!   (`ENDPOINTS=http://a:2379,http://b:2379`) or a table of items numbered from 0
//!   (`ENDPOINTS__0=…`, `ENDPOINTS__1=…`, which the `config` crate delivers as keys `"0"`,
//!   `"1"`): an environment variable carries one string, and a host that wants one variable
//!   per item numbers them.

use serde::de::value::{MapDeserializer, SeqDeserializer};
use serde::de::{self, IntoDeserializer, Visitor};
use serde::forward_to_deserialize_any;
use serde_json::{Map, Value};

/// The form of a setting name that matching compares: lower case, without `_` and `-`.
pub(crate) fn canonical(name: &str) -> String {
    name.chars()
        .filter(|c| *c != '_' && *c != '-')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// Renames each key of `map` to the field of `fields` it matches; unmatched keys stay as they
/// are so the struct can reject or ignore them.
fn match_fields(map: Map<String, Value>, fields: &[&str]) -> Vec<(String, Value)> {
    map.into_iter()
        .map(|(key, value)| {
            let wanted = canonical(&key);
            let name = fields
                .iter()
                .find(|field| canonical(field) == wanted)
                .map_or(key, |field| (*field).to_owned());
            (name, value)
        })
        .collect()
}

/// Why a setting did not bind, as data: the binder words its own messages from this and the
/// field's [`Expected`] type, never from a parser's text (which may quote the value).
#[derive(Debug)]
pub(crate) enum BindError {
    /// A required field is absent.
    Missing(&'static str),
    /// A setting no field takes.
    Unknown(String),
    /// A value of the wrong type or form; the parser's words are kept only for `Display`.
    Invalid(String),
}

impl std::fmt::Display for BindError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BindError::Missing(field) => write!(f, "missing field `{field}`"),
            BindError::Unknown(field) => write!(f, "unknown field `{field}`"),
            BindError::Invalid(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for BindError {}

impl de::Error for BindError {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        BindError::Invalid(msg.to_string())
    }

    fn missing_field(field: &'static str) -> Self {
        BindError::Missing(field)
    }

    fn unknown_field(field: &str, _expected: &'static [&'static str]) -> Self {
        BindError::Unknown(field.to_owned())
    }
}

fn invalid(error: serde_json::Error) -> BindError {
    BindError::Invalid(error.to_string())
}

/// The items of a list written as one string: separated by commas, each trimmed, blanks
/// left out (so an empty string is an empty list, and a trailing comma is harmless).
fn comma_separated(text: &str) -> Vec<Value> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| Value::String(item.to_owned()))
        .collect()
}

/// The items of a list written as a table numbered from 0 (`0`, `1`, …, each once), in
/// order. A table with any other key, or a gap, is not a list: a gap is as likely a typo.
fn numbered(map: Map<String, Value>) -> Result<Vec<Value>, BindError> {
    let not_a_list = || BindError::Invalid("a table that is not a list numbered from 0".into());
    let mut items: Vec<Option<Value>> = vec![None; map.len()];
    for (key, value) in map {
        let index: usize = key.trim().parse().map_err(|_| not_a_list())?;
        let slot = items.get_mut(index).ok_or_else(not_a_list)?;
        *slot = Some(value);
    }
    items
        .into_iter()
        .map(|item| item.ok_or_else(not_a_list))
        .collect()
}

/// A configuration value that binds leniently (see the module docs).
pub(crate) struct Lenient(pub(crate) Value);

impl<'de> IntoDeserializer<'de, BindError> for Lenient {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

fn visit_entries<'de, V: Visitor<'de>>(
    entries: Vec<(String, Value)>,
    visitor: V,
) -> Result<V::Value, BindError> {
    let mut map = MapDeserializer::new(
        entries
            .into_iter()
            .map(|(key, value)| (key, Lenient(value))),
    );
    let value = visitor.visit_map(&mut map)?;
    map.end()?;
    Ok(value)
}

/// Parses a string setting as a number of the wanted kind, or hands the value on unchanged.
macro_rules! lenient_number {
    ($($method:ident => $ty:ty, $visit:ident;)+) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
                if let Value::String(text) = &self.0 {
                    if let Ok(number) = text.trim().parse::<$ty>() {
                        return visitor.$visit(number);
                    }
                }
                self.0.$method(visitor).map_err(invalid)
            }
        )+
    };
}

impl<'de> de::Deserializer<'de> for Lenient {
    type Error = BindError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.0.deserialize_any(visitor).map_err(invalid)
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        if let Value::String(text) = &self.0 {
            match text.trim().to_ascii_lowercase().as_str() {
                "true" => return visitor.visit_bool(true),
                "false" => return visitor.visit_bool(false),
                _ => {}
            }
        }
        self.0.deserialize_bool(visitor).map_err(invalid)
    }

    lenient_number! {
        deserialize_u8 => u64, visit_u64;
        deserialize_u16 => u64, visit_u64;
        deserialize_u32 => u64, visit_u64;
        deserialize_u64 => u64, visit_u64;
        deserialize_i8 => i64, visit_i64;
        deserialize_i16 => i64, visit_i64;
        deserialize_i32 => i64, visit_i64;
        deserialize_i64 => i64, visit_i64;
        deserialize_f32 => f64, visit_f64;
        deserialize_f64 => f64, visit_f64;
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match &self.0 {
            Value::Null => visitor.visit_none(),
            Value::String(text) if text.trim().is_empty() => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        let items = match self.0 {
            Value::Array(items) => items,
            Value::String(text) => comma_separated(&text),
            Value::Object(map) => numbered(map)?,
            other => return other.deserialize_seq(visitor).map_err(invalid),
        };
        let mut seq = SeqDeserializer::new(items.into_iter().map(Lenient));
        let value = visitor.visit_seq(&mut seq)?;
        seq.end()?;
        Ok(value)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Object(map) => visit_entries(map.into_iter().collect(), visitor),
            other => other.deserialize_map(visitor).map_err(invalid),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        match self.0 {
            Value::Object(map) => visit_entries(match_fields(map, fields), visitor),
            other => other
                .deserialize_struct(name, fields, visitor)
                .map_err(invalid),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0
            .deserialize_enum(name, variants, visitor)
            .map_err(invalid)
    }

    fn deserialize_tuple<V: Visitor<'de>>(
        self,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.deserialize_seq(visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.deserialize_seq(visitor)
    }

    forward_to_deserialize_any! {
        char str string bytes byte_buf unit unit_struct identifier ignored_any i128 u128
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde::Deserialize;
    use serde_json::json;

    use super::*;
    use crate::registry::tests::Pool;

    fn bind(value: Value) -> Result<Pool, BindError> {
        Pool::deserialize(Lenient(value))
    }

    #[test]
    fn field_names_match_ignoring_case_underscores_and_dashes() {
        let pool = bind(json!({
            "CONNECTION_STRING": "host=db",
            "maxConnections": 8,
            "TLS": true,
            "check-every": "5s",
        }))
        .unwrap();
        assert_eq!(pool.connection_string, "host=db");
        assert_eq!(pool.max_connections, 8);
        assert!(pool.tls);
        assert_eq!(pool.check_every, Some(Duration::from_secs(5)));
    }

    #[test]
    fn strings_bind_numbers_and_booleans_as_environment_variables_carry_them() {
        let pool = bind(json!({
            "connection_string": "host=db",
            "max_connections": " 16 ",
            "tls": "False",
            "check_every": "",
        }))
        .unwrap();
        assert_eq!(pool.max_connections, 16);
        assert!(!pool.tls);
        assert_eq!(pool.check_every, None, "an empty string unsets an option");
    }

    #[test]
    fn values_that_do_not_parse_still_fail() {
        let err = bind(json!({"connection_string": "x", "max_connections": "many", "tls": true}))
            .unwrap_err();
        assert!(err.to_string().contains("expected u32"), "{err}");
        let err = bind(json!({"connection_string": "x", "max_connections": 1, "tls": "yes"}))
            .unwrap_err();
        assert!(err.to_string().contains("expected a boolean"), "{err}");
    }

    #[test]
    fn unknown_fields_are_still_rejected_by_strict_structs() {
        let err = bind(json!({
            "connection_string": "x", "max_connections": 1, "tls": true, "colour": "blue"
        }))
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `colour`"), "{err}");
    }

    #[derive(Debug, Deserialize, PartialEq)]
    struct Cluster {
        endpoints: Vec<String>,
        #[serde(default)]
        ports: Vec<u16>,
    }

    fn cluster(value: Value) -> Result<Cluster, BindError> {
        Cluster::deserialize(Lenient(value))
    }

    #[test]
    fn a_list_binds_from_a_list_a_comma_separated_string_or_items_numbered_from_0() {
        let want = vec!["http://a:2379".to_owned(), "http://b:2379".to_owned()];
        for endpoints in [
            json!(["http://a:2379", "http://b:2379"]),
            json!(" http://a:2379 , http://b:2379,"),
            json!({"1": "http://b:2379", "0": "http://a:2379"}),
        ] {
            let bound = cluster(json!({ "endpoints": endpoints.clone() })).unwrap();
            assert_eq!(bound.endpoints, want, "{endpoints}");
        }
        let one = cluster(json!({"endpoints": "http://a:2379"})).unwrap();
        assert_eq!(one.endpoints, ["http://a:2379"]);
        let none = cluster(json!({"endpoints": ""})).unwrap();
        assert!(
            none.endpoints.is_empty(),
            "an empty string is an empty list"
        );
        // Each item binds leniently too: environment variables carry numbers as strings.
        let ports = cluster(json!({"endpoints": [], "ports": "2379, 22379"})).unwrap();
        assert_eq!(ports.ports, [2379, 22379]);
        let ports = cluster(json!({"endpoints": [], "ports": {"0": "2379"}})).unwrap();
        assert_eq!(ports.ports, [2379]);
    }

    #[test]
    fn a_table_with_a_gap_or_a_name_is_not_a_list() {
        for endpoints in [
            json!({"0": "http://a:2379", "2": "http://b:2379"}),
            json!({"1": "http://b:2379"}),
            json!({"first": "http://a:2379"}),
        ] {
            let err = cluster(json!({ "endpoints": endpoints.clone() })).unwrap_err();
            assert!(matches!(err, BindError::Invalid(_)), "{endpoints}: {err}");
        }
    }

    #[test]
    fn canonical_names_ignore_case_and_separators() {
        assert_eq!(canonical("CONNECTION_STRING"), "connectionstring");
        assert_eq!(canonical("connection-string"), "connectionstring");
        assert_eq!(canonical("ConnectionString"), "connectionstring");
    }
}
