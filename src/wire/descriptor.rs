//! The versioned JSON envelope of remote-buffer descriptors, byte-compatible with PyTorch's
//! `_serialization._WireDescriptor` (`docs/transport-contract.md` §1):
//!
//! ```text
//! {"version":1,"backend":"<name>","fields":{...}}
//! ```
//!
//! Compact separators, ASCII only (non-ASCII escaped as `\uXXXX`), fields in declaration order,
//! `bytes` fields as padded standard base64. Decoding is strict: exact key sets, duplicate keys
//! rejected at any depth, integers non-negative and never booleans or floats, base64 validated.
//! It never panics on any input (a property test and a fuzz target check this).

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};

/// The envelope version this codec reads and writes.
pub const VERSION: u64 = 1;

/// The type of one descriptor field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A non-negative integer up to 2^64-1.
    Int,
    /// A string.
    Str,
    /// Bytes, carried as base64.
    Bytes,
}

/// One field's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// An integer.
    Int(u64),
    /// A string.
    Str(String),
    /// Bytes.
    Bytes(Vec<u8>),
}

/// Why a descriptor was refused; the messages are PyTorch's.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// Not UTF-8, not JSON, or bad base64.
    #[error("malformed descriptor")]
    Malformed,
    /// A key appears twice in one object.
    #[error("duplicate descriptor field {0:?}")]
    DuplicateField(String),
    /// The top level is not an object with exactly `version`, `backend` and `fields`.
    #[error("invalid descriptor envelope")]
    InvalidEnvelope,
    /// `version` is not the integer 1.
    #[error("unsupported descriptor version")]
    UnsupportedVersion,
    /// `backend` names another backend.
    #[error("descriptor belongs to a different backend")]
    DifferentBackend,
    /// `fields` is not an object with exactly the declared keys.
    #[error("invalid descriptor fields")]
    InvalidFields,
    /// A field has the wrong type or a negative value.
    #[error("invalid descriptor field {0:?}")]
    InvalidField(String),
    /// Longer than [`MAX_LEN`].
    #[error("descriptor of {0} bytes exceeds the limit of {MAX_LEN} bytes")]
    TooLong(usize),
}

/// A JSON value that remembers every key of every object, duplicates included.
#[derive(Debug)]
enum Json {
    Null,
    Bool,
    Uint(u64),
    Neg,
    Float,
    Str(String),
    Arr,
    Obj(Vec<(String, Json)>),
}

impl<'de> de::Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Json, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Json;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_unit<E>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Json, E> {
                Ok(Json::Bool)
            }
            fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
                Ok(Json::Uint(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
                Ok(if v >= 0 { Json::Uint(v as u64) } else { Json::Neg })
            }
            fn visit_f64<E>(self, _: f64) -> Result<Json, E> {
                Ok(Json::Float)
            }
            fn visit_str<E>(self, v: &str) -> Result<Json, E> {
                Ok(Json::Str(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Json, E> {
                Ok(Json::Str(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Json, A::Error> {
                while a.next_element::<Json>()?.is_some() {}
                Ok(Json::Arr)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Json, A::Error> {
                let mut entries = Vec::new();
                while let Some((k, v)) = a.next_entry::<String, Json>()? {
                    entries.push((k, v));
                }
                Ok(Json::Obj(entries))
            }
        }
        d.deserialize_any(V)
    }
}

/// The first key that appears twice in one object, depth first. Linear in the number of keys
/// (a set per object): a descriptor is untrusted input, and a quadratic scan of a few
/// megabytes of keys would hold the caller for minutes.
fn first_duplicate(j: &Json) -> Option<String> {
    let Json::Obj(entries) = j else { return None };
    let mut seen = std::collections::HashSet::with_capacity(entries.len());
    for (k, v) in entries {
        if !seen.insert(k.as_str()) {
            return Some(k.clone());
        }
        if let Some(d) = first_duplicate(v) {
            return Some(d);
        }
    }
    None
}

/// The longest descriptor accepted. Descriptors carry a handful of fields (PyTorch's backends
/// and symmem's are under 1 KiB); anything near this is not one. PyTorch sets no limit; this
/// one bounds what a peer's bytes can make a receiver parse.
pub const MAX_LEN: usize = 1 << 20;

fn parse(data: &[u8]) -> Result<Vec<(String, Json)>, DescriptorError> {
    if data.len() > MAX_LEN {
        return Err(DescriptorError::TooLong(data.len()));
    }
    let text = std::str::from_utf8(data).map_err(|_| DescriptorError::Malformed)?;
    let json: Json = serde_json::from_str(text).map_err(|_| DescriptorError::Malformed)?;
    if let Some(k) = first_duplicate(&json) {
        return Err(DescriptorError::DuplicateField(k));
    }
    let Json::Obj(top) = json else { return Err(DescriptorError::InvalidEnvelope) };
    let mut keys: Vec<&str> = top.iter().map(|(k, _)| k.as_str()).collect();
    keys.sort_unstable();
    if keys != ["backend", "fields", "version"] {
        return Err(DescriptorError::InvalidEnvelope);
    }
    Ok(top)
}

fn get<'a>(top: &'a [(String, Json)], key: &str) -> &'a Json {
    // `parse` checked that the key exists.
    top.iter().find(|(k, _)| k == key).map_or(&Json::Null, |(_, v)| v)
}

/// The backend a descriptor names, after checking its envelope; for dispatching to the right
/// schema.
pub fn backend_of(data: &[u8]) -> Result<String, DescriptorError> {
    let top = parse(data)?;
    check_version(&top)?;
    match get(&top, "backend") {
        Json::Str(s) => Ok(s.clone()),
        _ => Err(DescriptorError::InvalidEnvelope),
    }
}

fn check_version(top: &[(String, Json)]) -> Result<(), DescriptorError> {
    match get(top, "version") {
        Json::Uint(VERSION) => Ok(()),
        _ => Err(DescriptorError::UnsupportedVersion),
    }
}

/// Decodes a descriptor of `backend` whose fields are `schema`, returning the values in schema
/// order.
pub fn decode(data: &[u8], backend: &str, schema: &[(&str, Kind)]) -> Result<Vec<Value>, DescriptorError> {
    let top = parse(data)?;
    check_version(&top)?;
    if !matches!(get(&top, "backend"), Json::Str(b) if b == backend) {
        return Err(DescriptorError::DifferentBackend);
    }
    let Json::Obj(fields) = get(&top, "fields") else { return Err(DescriptorError::InvalidFields) };
    if fields.len() != schema.len() || schema.iter().any(|(name, _)| !fields.iter().any(|(k, _)| k == name)) {
        return Err(DescriptorError::InvalidFields);
    }
    schema
        .iter()
        .map(|&(name, kind)| {
            let bad = || DescriptorError::InvalidField(name.to_string());
            let v = fields.iter().find(|(k, _)| k == name).map(|(_, v)| v).ok_or_else(bad)?;
            match (kind, v) {
                (Kind::Int, Json::Uint(n)) => Ok(Value::Int(*n)),
                (Kind::Str, Json::Str(s)) => Ok(Value::Str(s.clone())),
                (Kind::Bytes, Json::Str(s)) => STANDARD.decode(s).map(Value::Bytes).map_err(|_| bad()),
                _ => Err(bad()),
            }
        })
        .collect()
}

/// Encodes a descriptor: fields in the given order, compact, ASCII.
pub fn encode(backend: &str, fields: &[(&str, Value)]) -> Vec<u8> {
    let mut out = String::with_capacity(128);
    out.push_str("{\"version\":1,\"backend\":");
    push_str(&mut out, backend);
    out.push_str(",\"fields\":{");
    for (i, (name, v)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_str(&mut out, name);
        out.push(':');
        match v {
            Value::Int(n) => out.push_str(&n.to_string()),
            Value::Str(s) => push_str(&mut out, s),
            Value::Bytes(b) => push_str(&mut out, &STANDARD.encode(b)),
        }
    }
    out.push_str("}}");
    out.into_bytes()
}

/// A JSON string as Python's `json.dumps(ensure_ascii=True)` writes it.
fn push_str(out: &mut String, s: &str) {
    use std::fmt::Write;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    // Writing to a String cannot fail.
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TEST: &[(&str, Kind)] = &[("address", Kind::Int), ("name", Kind::Str), ("metadata", Kind::Bytes)];

    fn sample() -> Vec<u8> {
        encode(
            "test",
            &[
                ("address", Value::Int(u64::MAX)),
                ("name", Value::Str("peer\u{2603}".into())),
                ("metadata", Value::Bytes(b"\x00\xffdata".to_vec())),
            ],
        )
    }

    #[test]
    fn encodes_like_python_and_round_trips() {
        // json.dumps({...}, separators=(",",":"), ensure_ascii=True) of PyTorch's round-trip test.
        let want = br#"{"version":1,"backend":"test","fields":{"address":18446744073709551615,"name":"peer\u2603","metadata":"AP9kYXRh"}}"#;
        assert_eq!(sample(), want.to_vec());
        let v = decode(&sample(), "test", TEST).unwrap();
        assert_eq!(v[0], Value::Int(u64::MAX));
        assert_eq!(v[1], Value::Str("peer\u{2603}".into()));
        assert_eq!(v[2], Value::Bytes(b"\x00\xffdata".to_vec()));
        assert_eq!(backend_of(&sample()).unwrap(), "test");
        // Astral characters become surrogate pairs, as Python writes them.
        assert_eq!(encode("t\u{1F600}", &[]), br#"{"version":1,"backend":"t\ud83d\ude00","fields":{}}"#.to_vec());
    }

    /// Every row of the contract's rejection table, and the registry test's inputs.
    #[test]
    fn rejects_everything_the_contract_rejects() {
        use DescriptorError::*;
        let env = |version: &str, backend: &str, fields: &str| {
            format!(r#"{{"version":{version},"backend":{backend},"fields":{fields}}}"#).into_bytes()
        };
        let ok_fields = r#"{"address":1,"name":"n","metadata":"AA=="}"#;
        let cases: Vec<(Vec<u8>, DescriptorError)> = vec![
            (b"not json".to_vec(), Malformed),
            (b"\xff".to_vec(), Malformed),
            (b"[]".to_vec(), InvalidEnvelope),
            (b"null".to_vec(), InvalidEnvelope),
            (br#"{"version":1,"version":1,"backend":"test","fields":{}}"#.to_vec(), DuplicateField("version".into())),
            (env("2", r#""test""#, ok_fields), UnsupportedVersion),
            (env("true", r#""test""#, ok_fields), UnsupportedVersion),
            (env("1.0", r#""test""#, ok_fields), UnsupportedVersion),
            (env("1", r#""nixl""#, ok_fields), DifferentBackend),
            (env("1", r#""test""#, "[]"), InvalidFields),
            (br#"{"version":1,"backend":"test","fields":{},"extra":0}"#.to_vec(), InvalidEnvelope),
            (br#"{"version":1,"backend":"test"}"#.to_vec(), InvalidEnvelope),
            (env("1", r#""test""#, r#"{"address":-1,"name":"n","metadata":"AA=="}"#), InvalidField("address".into())),
            (env("1", r#""test""#, r#"{"address":true,"name":"n","metadata":"AA=="}"#), InvalidField("address".into())),
            (env("1", r#""test""#, r#"{"address":1.5,"name":"n","metadata":"AA=="}"#), InvalidField("address".into())),
            (env("1", r#""test""#, r#"{"address":1,"name":1,"metadata":"AA=="}"#), InvalidField("name".into())),
            (env("1", r#""test""#, r#"{"address":1,"name":"n","metadata":"%%%"}"#), InvalidField("metadata".into())),
            (env("1", r#""test""#, r#"{"address":1,"name":"n","metadata":"AA"}"#), InvalidField("metadata".into())),
            (env("1", r#""test""#, r#"{"address":1,"name":"n","metadata":[]}"#), InvalidField("metadata".into())),
            (env("1", r#""test""#, r#"{"address":1,"name":"n","metadata":"AA==","x":0}"#), InvalidFields),
            (env("1", r#""test""#, "{}"), InvalidFields),
            (
                env("1", r#""test""#, r#"{"address":1,"address":2,"name":"n","metadata":"AA=="}"#),
                DuplicateField("address".into()),
            ),
            (
                env("1", r#""test""#, r#"{"address":18446744073709551616,"name":"n","metadata":"AA=="}"#),
                InvalidField("address".into()),
            ),
        ];
        for (data, want) in cases {
            assert_eq!(decode(&data, "test", TEST), Err(want.clone()), "{}", String::from_utf8_lossy(&data));
        }
    }

    proptest! {
        #[test]
        fn decode_never_panics(data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&data, "test", TEST);
            let _ = backend_of(&data);
        }

        #[test]
        fn any_values_round_trip(a in any::<u64>(), name in ".*", meta in proptest::collection::vec(any::<u8>(), 0..64)) {
            let bytes = encode("test", &[("address", Value::Int(a)), ("name", Value::Str(name.clone())), ("metadata", Value::Bytes(meta.clone()))]);
            prop_assert!(bytes.is_ascii());
            prop_assert_eq!(decode(&bytes, "test", TEST), Ok(vec![Value::Int(a), Value::Str(name), Value::Bytes(meta)]));
        }
    }
}
