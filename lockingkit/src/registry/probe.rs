//! What an options struct's `Deserialize` impl tells without any settings: its field names,
//! what each field expects, and which fields are required.
//!
//! Each question is asked by running the impl against a deserializer that answers nothing but
//! records what it was asked for, so the binder can word its problems from the field's type
//! (never from a parser's text, which may quote a value) and find unknown and missing settings
//! without reading error messages.

use serde::de::value::{MapDeserializer, SeqDeserializer};
use serde::de::{self, IntoDeserializer, Visitor};
use serde::forward_to_deserialize_any;

use super::lenient::BindError;
use crate::config::Problem;

/// The field names a struct deserializes, found by asking its `Deserialize` impl; `None` for
/// types that do not deserialize as a plain struct (maps, flattened or transparent structs).
pub(crate) fn struct_fields<T: de::DeserializeOwned>() -> Option<&'static [&'static str]> {
    match T::deserialize(FieldProbe) {
        Err(Probed(fields)) => fields,
        Ok(_) => None,
    }
}

/// A deserializer that answers nothing and reports the fields it was asked for.
struct FieldProbe;

#[derive(Debug)]
struct Probed(Option<&'static [&'static str]>);

impl std::fmt::Display for Probed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("field probe")
    }
}

impl std::error::Error for Probed {}

impl de::Error for Probed {
    fn custom<T: std::fmt::Display>(_msg: T) -> Self {
        Probed(None)
    }
}

impl<'de> de::Deserializer<'de> for FieldProbe {
    type Error = Probed;

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Probed> {
        Err(Probed(None))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _visitor: V,
    ) -> Result<V::Value, Probed> {
        Err(Probed(Some(fields)))
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// What a field expects, found by asking its `Deserialize` impl which type it wants.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expected {
    /// An unsigned integer up to `max`.
    Unsigned(u64),
    /// A signed integer.
    Signed,
    /// A number.
    Float,
    /// `true` or `false`.
    Bool,
    /// Text.
    Text,
    /// A secret ([`SecretString`](crate::config::SecretString)).
    Secret,
    /// A duration ([`crate::config::duration`]).
    Duration,
    /// A list (see [`Lenient`](super::lenient::Lenient) for the forms it takes).
    List,
    /// Anything else (a table, a custom type).
    Other,
}

impl Expected {
    /// The problem of the setting at `path` whose `value` did not bind: worded from the type,
    /// and from the value's sign for a duration (`"-1s"` has its unit; its sign is wrong), never
    /// quoting the value.
    pub(crate) fn problem(self, path: String, value: &serde_json::Value) -> Problem {
        match self {
            Expected::Duration if is_negative(value) => {
                Problem::new(path, crate::config::NEGATIVE_DURATION)
            }
            expected => Problem::detail(path, expected.describe()),
        }
    }

    /// What to write instead, for a setting that did not bind.
    pub(crate) fn describe(self) -> String {
        match self {
            Expected::Unsigned(max) => format!("expected a whole number from 0 to {max}"),
            Expected::Signed => "expected a whole number".to_owned(),
            Expected::Float => "expected a number".to_owned(),
            Expected::Bool => "expected true or false".to_owned(),
            Expected::Text | Expected::Secret => "expected a string".to_owned(),
            Expected::Duration => crate::config::EXPECTED_DURATION.to_owned(),
            Expected::List => "expected a list, one string of items separated by commas, or \
                               items numbered from 0"
                .to_owned(),
            Expected::Other => "has the wrong type or form".to_owned(),
        }
    }
}

/// Whether `value` is a negative number, or text that starts like one.
fn is_negative(value: &serde_json::Value) -> bool {
    match value {
        serde_json::Value::Number(number) => number.as_f64().is_some_and(|n| n < 0.0),
        serde_json::Value::String(text) => text.trim_start().starts_with('-'),
        _ => false,
    }
}

/// What `field` of `T` expects.
pub(crate) fn expected<T: de::DeserializeOwned>(field: &'static str) -> Expected {
    match T::deserialize(OneField(field)) {
        Err(Probe(expected)) => expected,
        Ok(_) => Expected::Other,
    }
}

/// The answer of a probe, carried as its error.
#[derive(Debug)]
struct Probe(Expected);

impl std::fmt::Display for Probe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("type probe")
    }
}

impl std::error::Error for Probe {}

impl de::Error for Probe {
    fn custom<T: std::fmt::Display>(_msg: T) -> Self {
        Probe(Expected::Other)
    }
}

/// A struct with one field set, whose value answers which type it was asked for.
struct OneField(&'static str);

impl<'de> de::Deserializer<'de> for OneField {
    type Error = Probe;

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Probe> {
        Err(Probe(Expected::Other))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Probe> {
        visitor.visit_map(MapDeserializer::new(std::iter::once((self.0, TypeProbe))))
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// A value that fails with the type it was asked for.
struct TypeProbe;

impl<'de> IntoDeserializer<'de, Probe> for TypeProbe {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

macro_rules! probe_as {
    ($($method:ident => $expected:expr;)+) => {
        $(
            fn $method<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Probe> {
                Err(Probe($expected))
            }
        )+
    };
}

impl<'de> de::Deserializer<'de> for TypeProbe {
    type Error = Probe;

    probe_as! {
        deserialize_any => Expected::Other;
        deserialize_u8 => Expected::Unsigned(u8::MAX.into());
        deserialize_u16 => Expected::Unsigned(u16::MAX.into());
        deserialize_u32 => Expected::Unsigned(u32::MAX.into());
        deserialize_u64 => Expected::Unsigned(u64::MAX);
        deserialize_i8 => Expected::Signed;
        deserialize_i16 => Expected::Signed;
        deserialize_i32 => Expected::Signed;
        deserialize_i64 => Expected::Signed;
        deserialize_f32 => Expected::Float;
        deserialize_f64 => Expected::Float;
        deserialize_bool => Expected::Bool;
        deserialize_str => Expected::Text;
        deserialize_string => Expected::Text;
        deserialize_char => Expected::Text;
        deserialize_seq => Expected::List;
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Probe> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Probe> {
        match name {
            crate::config::SECRET_NEWTYPE => Err(Probe(Expected::Secret)),
            crate::config::DURATION_NEWTYPE => Err(Probe(Expected::Duration)),
            _ => visitor.visit_newtype_struct(self),
        }
    }

    forward_to_deserialize_any! {
        i128 u128 bytes byte_buf unit unit_struct tuple tuple_struct map struct enum
        identifier ignored_any
    }
}

/// The required fields of `T` that `present` lacks, found by binding a stand-in value for
/// every present field and asking serde which field it misses, until it misses none.
pub(crate) fn missing_fields<T: de::DeserializeOwned>(
    present: &[&'static str],
) -> Vec<&'static str> {
    let mut given = present.to_vec();
    let mut missing = Vec::new();
    let limit = struct_fields::<T>().map_or(0, <[_]>::len);
    for _ in 0..=limit {
        let entries = given.iter().map(|field| (*field, StandIn));
        match T::deserialize(StandInStruct(entries.collect())) {
            Err(BindError::Missing(field)) if !given.contains(&field) => {
                missing.push(field);
                given.push(field);
            }
            _ => break,
        }
    }
    missing
}

/// A struct whose given fields hold [`StandIn`] values.
struct StandInStruct(Vec<(&'static str, StandIn)>);

impl<'de> de::Deserializer<'de> for StandInStruct {
    type Error = BindError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_map(MapDeserializer::new(self.0.into_iter()))
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map struct enum identifier
        ignored_any
    }
}

/// A value that binds as the zero of whatever type asks for it.
#[derive(Clone, Copy)]
struct StandIn;

impl<'de> IntoDeserializer<'de, BindError> for StandIn {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

impl<'de> de::Deserializer<'de> for StandIn {
    type Error = BindError;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_u64(0)
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_bool(false)
    }

    fn deserialize_i64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_i64(0)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_f64(0.0)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_str("")
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_none()
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, BindError> {
        if name == crate::config::DURATION_NEWTYPE {
            // A duration takes no bare number: its zero is written with a unit.
            return visitor.visit_str("0ms");
        }
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_seq(SeqDeserializer::new(std::iter::empty::<StandIn>()))
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_map(MapDeserializer::new(std::iter::empty::<(&str, StandIn)>()))
    }

    fn deserialize_unit<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_unit()
    }

    forward_to_deserialize_any! {
        i8 i16 i32 i128 u8 u16 u32 u64 u128 f32 char bytes byte_buf unit_struct tuple
        tuple_struct struct enum identifier ignored_any
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, BindError> {
        visitor.visit_str("")
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;
    use crate::registry::tests::Pool;

    #[test]
    fn struct_fields_are_read_from_the_deserialize_impl() {
        assert_eq!(
            struct_fields::<Pool>(),
            Some(&["connection_string", "max_connections", "tls", "check_every"][..])
        );
        assert_eq!(
            struct_fields::<std::collections::HashMap<String, String>>(),
            None
        );
    }

    #[test]
    fn each_field_says_what_it_expects() {
        assert_eq!(
            expected::<Pool>("max_connections"),
            Expected::Unsigned(u32::MAX.into())
        );
        assert_eq!(expected::<Pool>("tls"), Expected::Bool);
        assert_eq!(expected::<Pool>("connection_string"), Expected::Text);
        assert_eq!(expected::<Pool>("check_every"), Expected::Duration);

        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct Vault {
            token: crate::config::SecretString,
        }
        assert_eq!(expected::<Vault>("token"), Expected::Secret);
    }

    #[test]
    fn missing_required_fields_are_found_without_reading_error_text() {
        assert_eq!(
            missing_fields::<Pool>(&["tls"]),
            ["connection_string", "max_connections"]
        );
        assert!(
            missing_fields::<Pool>(&["connection_string", "max_connections", "tls"]).is_empty()
        );
    }
}
