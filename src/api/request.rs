//! Request bodies: parsed by hand from a JSON value, so every error names its field
//! (serde's derive messages say "invalid type" without saying where). Validation is complete
//! before anything reaches a store: a rejected request changes nothing.

use std::sync::Arc;

use serde_json::{Map, Value};

use crate::api::error::ApiError;
use crate::limiter::Check;
use crate::policy::{Policies, Policy};

/// Caps from `[server]`.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub max_body_bytes: usize,
    pub max_batch: usize,
    pub max_key_bytes: usize,
}

/// A parsed `POST /v1/check` body.
#[derive(Debug)]
pub enum CheckRequest {
    Single(Check),
    Batch(Vec<Check>),
}

pub fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::InvalidJson(e.to_string()))
}

fn object<'a>(v: &'a Value, what: &str) -> Result<&'a Map<String, Value>, ApiError> {
    v.as_object()
        .ok_or_else(|| ApiError::invalid(what, "must be a JSON object"))
}

fn no_unknown_fields(
    obj: &Map<String, Value>,
    allowed: &[&str],
    prefix: &str,
) -> Result<(), ApiError> {
    match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(
            format!("{prefix}{k}"),
            format!("unknown field; expected {}", allowed.join(", ")),
        )),
        None => Ok(()),
    }
}

fn string_field<'a>(
    obj: &'a Map<String, Value>,
    name: &str,
    prefix: &str,
) -> Result<&'a str, ApiError> {
    match obj.get(name) {
        None => Err(ApiError::invalid(
            format!("{prefix}{name}"),
            "missing field",
        )),
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(ApiError::invalid(
            format!("{prefix}{name}"),
            "must be a string",
        )),
    }
}

fn policy<'a>(
    policies: &'a Policies,
    obj: &Map<String, Value>,
    prefix: &str,
) -> Result<&'a Arc<Policy>, ApiError> {
    let name = string_field(obj, "policy", prefix)?;
    policies.get(name).ok_or_else(|| ApiError::UnknownPolicy {
        field: format!("{prefix}policy"),
        name: name.chars().take(80).collect(),
    })
}

fn key(obj: &Map<String, Value>, prefix: &str, caps: &Caps) -> Result<String, ApiError> {
    let key = string_field(obj, "key", prefix)?;
    if key.is_empty() {
        return Err(ApiError::invalid(
            format!("{prefix}key"),
            "must not be empty",
        ));
    }
    if key.len() > caps.max_key_bytes {
        return Err(ApiError::invalid(
            format!("{prefix}key"),
            format!(
                "is {} bytes; at most {} allowed",
                key.len(),
                caps.max_key_bytes
            ),
        ));
    }
    Ok(key.to_owned())
}

fn cost(obj: &Map<String, Value>, prefix: &str, policy: &Policy) -> Result<u64, ApiError> {
    let field = format!("{prefix}cost");
    let cost = match obj.get("cost") {
        None => 1,
        Some(Value::Number(n)) => match n.as_u64() {
            Some(c) => c,
            None if n.as_i64().is_some() => {
                return Err(ApiError::invalid(field, "must not be negative"));
            }
            None => {
                return Err(ApiError::invalid(
                    field,
                    "must be a whole number (0 = peek)",
                ));
            }
        },
        Some(_) => return Err(ApiError::invalid(field, "must be an integer")),
    };
    let capacity = policy.capacity();
    if cost > capacity {
        return Err(ApiError::invalid(
            field,
            format!(
                "{cost} exceeds the capacity {capacity} of policy \"{}\"; it could never pass",
                policy.name
            ),
        ));
    }
    Ok(cost)
}

fn check(v: &Value, prefix: &str, policies: &Policies, caps: &Caps) -> Result<Check, ApiError> {
    let what = if prefix.is_empty() {
        "body"
    } else {
        prefix.trim_end_matches('.')
    };
    let obj = object(v, what)?;
    no_unknown_fields(obj, &["policy", "key", "cost"], prefix)?;
    let policy = policy(policies, obj, prefix)?;
    let key = key(obj, prefix, caps)?;
    let cost = cost(obj, prefix, policy)?;
    Ok(Check {
        policy: policy.clone(),
        key,
        cost,
    })
}

impl CheckRequest {
    pub fn parse(v: &Value, policies: &Policies, caps: &Caps) -> Result<CheckRequest, ApiError> {
        let obj = object(v, "body")?;
        let Some(checks) = obj.get("checks") else {
            return check(v, "", policies, caps).map(CheckRequest::Single);
        };
        no_unknown_fields(obj, &["checks"], "")?;
        let list = checks
            .as_array()
            .ok_or_else(|| ApiError::invalid("checks", "must be an array of checks"))?;
        if list.is_empty() {
            return Err(ApiError::invalid("checks", "must hold at least one check"));
        }
        if list.len() > caps.max_batch {
            return Err(ApiError::BatchTooLarge {
                max: caps.max_batch,
                got: list.len(),
            });
        }
        list.iter()
            .enumerate()
            .map(|(i, c)| check(c, &format!("checks[{i}]."), policies, caps))
            .collect::<Result<Vec<_>, _>>()
            .map(CheckRequest::Batch)
    }
}

/// A parsed `POST /v1/reset` body.
pub fn parse_reset(
    v: &Value,
    policies: &Policies,
    caps: &Caps,
) -> Result<(Arc<Policy>, String), ApiError> {
    let obj = object(v, "body")?;
    no_unknown_fields(obj, &["policy", "key"], "")?;
    let policy = policy(policies, obj, "")?.clone();
    let key = key(obj, "", caps)?;
    Ok((policy, key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Algorithm;
    use crate::policy::{FailMode, PolicySpec};
    use serde_json::json;
    use std::time::Duration;

    fn setup() -> (Policies, Caps) {
        let spec = PolicySpec {
            name: "api",
            algorithm: Algorithm::TokenBucket,
            limit: 10,
            window: Duration::from_secs(1),
            burst: Some(20),
            on_store_error: FailMode::Open,
            shadow: false,
            global: None,
        };
        let p = Policy::new("rl", spec).unwrap();
        let caps = Caps {
            max_body_bytes: 1024,
            max_batch: 2,
            max_key_bytes: 8,
        };
        (Policies::new([p]), caps)
    }

    fn err(v: Value) -> ApiError {
        let (p, c) = setup();
        CheckRequest::parse(&v, &p, &c).unwrap_err()
    }

    #[test]
    fn every_bad_field_is_named() {
        let field = |e: ApiError| match e {
            ApiError::InvalidRequest { field, .. } | ApiError::UnknownPolicy { field, .. } => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(err(json!({"policy": "api"}))), "key");
        assert_eq!(field(err(json!({"policy": "api", "key": ""}))), "key");
        assert_eq!(
            field(err(json!({"policy": "api", "key": "123456789"}))),
            "key"
        );
        assert_eq!(field(err(json!({"policy": "nope", "key": "k"}))), "policy");
        assert_eq!(
            field(err(json!({"policy": "api", "key": "k", "cost": -1}))),
            "cost"
        );
        assert_eq!(
            field(err(json!({"policy": "api", "key": "k", "cost": 1.5}))),
            "cost"
        );
        assert_eq!(
            field(err(json!({"policy": "api", "key": "k", "cost": 21}))),
            "cost"
        );
        assert_eq!(
            field(err(json!({"policy": "api", "key": "k", "x": 1}))),
            "x"
        );
        assert_eq!(
            field(err(
                json!({"checks": [{"policy": "api", "key": "k"}, {"policy": "api"}]})
            )),
            "checks[1].key"
        );
        assert!(matches!(
            err(
                json!({"checks": [{"policy": "api", "key": "k"}, {"policy": "api", "key": "k"}, {"policy": "api", "key": "k"}]})
            ),
            ApiError::BatchTooLarge { max: 2, got: 3 }
        ));
    }

    #[test]
    fn cost_within_burst_is_accepted_and_defaults_to_one() {
        let (p, c) = setup();
        let CheckRequest::Single(ch) =
            CheckRequest::parse(&json!({"policy": "api", "key": "k"}), &p, &c).unwrap()
        else {
            panic!()
        };
        assert_eq!(ch.cost, 1);
        assert!(
            CheckRequest::parse(&json!({"policy": "api", "key": "k", "cost": 20}), &p, &c).is_ok()
        );
    }
}
