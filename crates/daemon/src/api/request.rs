//! Request bodies: parsed by hand from a JSON value, so every error names its field
//! (serde's derive messages say "invalid type" without saying where). Validation is complete
//! before anything reaches a store: a rejected request changes nothing.

use std::sync::Arc;

use serde_json::{Map, Value};

use crate::api::error::ApiError;
use crate::layout::ReservationId;
use crate::limiter::{Acquire, Check, Held, LeaseId};
use crate::policy::{ConcurrencyPolicy, Policies, Policy};
use std::time::Duration;

/// Caps from `[server]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    pub(crate) max_body_bytes: usize,
    pub(crate) max_batch: usize,
    pub(crate) max_key_bytes: usize,
    pub(crate) body_timeout: std::time::Duration,
}

/// A parsed `POST /v1/check` body.
#[derive(Debug)]
pub(crate) enum CheckRequest {
    Single(Check),
    Batch(Vec<Check>),
}

/// Parses a body as JSON, refusing duplicate object keys: with serde_json's last-wins,
/// `{"key":"A","key":"B","cost":1,"cost":0}` would be a peek on B, which is not what any
/// client meant to send. The error names the duplicated field's path (`checks[1].key`).
pub(crate) fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    let duplicate = std::cell::RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(body);
    let root = Strict {
        at: Step::Root,
        duplicate: &duplicate,
    };
    let parsed =
        serde::de::DeserializeSeed::deserialize(root, &mut de).and_then(|v| de.end().map(|()| v));
    match (parsed, duplicate.into_inner()) {
        (_, Some(path)) => Err(ApiError::invalid(
            path,
            "appears more than once in its object; send each field once",
        )),
        (Ok(v), None) => Ok(v),
        (Err(e), None) => Err(ApiError::InvalidJson(e.to_string())),
    }
}

/// Where a value sits, as a chain back to the root: built for free on the way down, and
/// written out only for a duplicate (formatting every path would cost time quadratic in a
/// hostile body's size).
#[derive(Clone, Copy)]
enum Step<'p> {
    Root,
    Key(&'p Step<'p>, &'p str),
    Index(&'p Step<'p>, usize),
}

impl Step<'_> {
    fn path(&self) -> String {
        match self {
            Step::Root => String::new(),
            Step::Key(parent, k) => match parent.path() {
                p if p.is_empty() => (*k).to_owned(),
                p => format!("{p}.{k}"),
            },
            Step::Index(parent, i) => format!("{}[{i}]", parent.path()),
        }
    }
}

/// A JSON value whose objects may not repeat a key; records the first repeated key's path.
struct Strict<'p, 'd> {
    at: Step<'p>,
    duplicate: &'d std::cell::RefCell<Option<String>>,
}

impl<'de> serde::de::DeserializeSeed<'de> for Strict<'_, '_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Strict<'_, '_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        loop {
            let at = Step::Index(&self.at, out.len());
            let next = seq.next_element_seed(Strict {
                at,
                duplicate: self.duplicate,
            })?;
            match next {
                Some(v) => out.push(v),
                None => return Ok(Value::Array(out)),
            }
        }
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let at = Step::Key(&self.at, &key);
            if out.contains_key(&key) {
                *self.duplicate.borrow_mut() = Some(at.path());
                return Err(serde::de::Error::custom("duplicate field"));
            }
            let v = map.next_value_seed(Strict {
                at,
                duplicate: self.duplicate,
            })?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
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
    if policies.concurrency(name).is_some() {
        return Err(ApiError::invalid(
            format!("{prefix}policy"),
            format!(
                "\"{name}\" is a concurrency limit: acquire and release it (POST /v1/acquire, /v1/release)"
            ),
        ));
    }
    policies.get(name).ok_or_else(|| ApiError::UnknownPolicy {
        field: format!("{prefix}policy"),
        name: name.chars().take(80).collect(),
    })
}

/// The concurrency limit a lease request names (a rate policy: 400; none: 404).
fn concurrency_policy<'a>(
    policies: &'a Policies,
    obj: &Map<String, Value>,
) -> Result<&'a Arc<ConcurrencyPolicy>, ApiError> {
    let name = string_field(obj, "policy", "")?;
    if policies.get(name).is_some() {
        return Err(ApiError::invalid(
            "policy",
            format!("\"{name}\" is a rate policy: check it with POST /v1/check"),
        ));
    }
    policies
        .concurrency(name)
        .ok_or_else(|| ApiError::UnknownPolicy {
            field: "policy".into(),
            name: name.chars().take(80).collect(),
        })
}

/// `hold_ms`: how long a lease lasts from now, 1 ms to the policy's lease (absent: the
/// policy's lease).
fn hold(obj: &Map<String, Value>, policy: &ConcurrencyPolicy) -> Result<Duration, ApiError> {
    let most = policy.lease.as_millis() as u64;
    if !obj.contains_key("hold_ms") {
        return Ok(policy.lease);
    }
    let ms = units(obj, "hold_ms", "", most, || {
        format!("at most the lease of policy \"{}\", {most} ms", policy.name)
    })?;
    if ms == 0 {
        return Err(ApiError::invalid("hold_ms", "must be at least 1"));
    }
    Ok(Duration::from_millis(ms))
}

/// A parsed `POST /v1/acquire` body.
pub(crate) fn parse_acquire(
    v: &Value,
    policies: &Policies,
    caps: &Caps,
) -> Result<Acquire, ApiError> {
    let obj = object(v, "body")?;
    no_unknown_fields(obj, &["policy", "key", "units", "hold_ms"], "")?;
    let policy = concurrency_policy(policies, obj)?.clone();
    let key = key(obj, "", caps)?;
    let limit = policy.limit.get();
    let units = units(obj, "units", "", limit, || {
        format!("at most the limit {limit} of policy \"{}\"", policy.name)
    })?;
    if units == 0 {
        return Err(ApiError::invalid("units", "must be at least 1"));
    }
    let hold = hold(obj, &policy)?;
    Ok(Acquire {
        policy,
        key,
        units,
        hold,
    })
}

/// A parsed `POST /v1/release` or `POST /v1/extend` body (`extend`: it may name a hold).
pub(crate) fn parse_held(
    v: &Value,
    policies: &Policies,
    caps: &Caps,
    extend: bool,
) -> Result<Held, ApiError> {
    let obj = object(v, "body")?;
    let fields: &[&str] = if extend {
        &["policy", "key", "lease", "hold_ms"]
    } else {
        &["policy", "key", "lease"]
    };
    no_unknown_fields(obj, fields, "")?;
    let policy = concurrency_policy(policies, obj)?.clone();
    let key = key(obj, "", caps)?;
    let text = string_field(obj, "lease", "")?;
    // Any unit count a lease can have, not the limit in force: a lease issued under a
    // higher limit is released or extended as it was issued (the store knows its units).
    let lease = LeaseId::parse(text, crate::policy::MAX_CONCURRENCY).ok_or_else(|| {
        ApiError::invalid(
            "lease",
            "must be a lease an acquire of this policy returned",
        )
    })?;
    let hold = hold(obj, &policy)?;
    Ok(Held {
        policy,
        key,
        lease,
        hold,
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
    let capacity = policy.capacity();
    let cost = units(obj, "cost", prefix, u64::MAX, || {
        format!(
            "at most the capacity {capacity} of policy \"{}\"",
            policy.name
        )
    })?;
    if cost > capacity {
        return Err(ApiError::invalid(
            format!("{prefix}cost"),
            format!(
                "{cost} exceeds the capacity {capacity} of policy \"{}\"; it could never pass",
                policy.name
            ),
        ));
    }
    Ok(cost)
}

/// 2^64: every whole float below it is a u64.
const U64_LIMIT: f64 = 18_446_744_073_709_551_616.0;

/// A whole number of units in field `name` (absent: 1), at most `max`; `bound` says what
/// the most is, for a number too large.
fn units(
    obj: &Map<String, Value>,
    name: &str,
    prefix: &str,
    max: u64,
    bound: impl Fn() -> String,
) -> Result<u64, ApiError> {
    let field = format!("{prefix}{name}");
    let n = match obj.get(name) {
        None => 1,
        Some(Value::Number(n)) => match (n.as_u64(), n.as_f64()) {
            (Some(c), _) => c,
            (None, Some(f)) if f < 0.0 => {
                return Err(ApiError::invalid(field, "must not be negative"));
            }
            (None, Some(f)) if f.fract() != 0.0 => {
                return Err(ApiError::invalid(
                    field,
                    format!("must be a whole number, got {n}"),
                ));
            }
            // A whole number written with a fraction or an exponent (`1.0`, `-0.0`,
            // `1e2`): JSON Schema's integer, as the OpenAPI contract declares it.
            (None, Some(f)) if f < U64_LIMIT => f as u64,
            // Past u64 (2^64 and up parse as floats): a size problem, not a format one.
            (None, _) => {
                return Err(ApiError::invalid(
                    field,
                    format!("{n} is too large: {}", bound()),
                ));
            }
        },
        Some(_) => return Err(ApiError::invalid(field, "must be an integer")),
    };
    if n > max {
        return Err(ApiError::invalid(
            field,
            format!("{n} is too large: {}", bound()),
        ));
    }
    Ok(n)
}

fn check(v: &Value, prefix: &str, policies: &Policies, caps: &Caps) -> Result<Check, ApiError> {
    let what = if prefix.is_empty() {
        "body"
    } else {
        prefix.trim_end_matches('.')
    };
    let obj = object(v, what)?;
    no_unknown_fields(obj, &["policy", "key", "cost", "group", "settle"], prefix)?;
    let base = policy(policies, obj, prefix)?;
    let key = key(obj, prefix, caps)?;
    // A key with an override is checked (and its cost bounded) under the override's limits.
    let policy = policies.for_key(base, &key);
    let cost = cost(obj, prefix, &policy)?;
    let group = group(obj, prefix, &policy, caps)?;
    let reserve = settle_flag(obj, prefix, &policy, cost, group.is_some())?;
    Ok(Check {
        policy,
        key,
        cost,
        group,
        reserve,
    })
}

/// `settle: true`: the cost is an estimate, reserved for `POST /v1/settle`. A single
/// check of a policy with `settle_within`, of at least 1 unit, in no group.
fn settle_flag(
    obj: &Map<String, Value>,
    prefix: &str,
    policy: &Policy,
    cost: u64,
    grouped: bool,
) -> Result<bool, ApiError> {
    let field = format!("{prefix}settle");
    match obj.get("settle") {
        None | Some(Value::Bool(false)) => return Ok(false),
        Some(Value::Bool(true)) => {}
        Some(_) => return Err(ApiError::invalid(field, "must be true or false")),
    }
    if !prefix.is_empty() {
        let why = "a batch cannot reserve: send each reservation as a single check";
        return Err(ApiError::invalid(field, why));
    }
    settling(policy, &field)?;
    let refusal = if grouped {
        "a check in a group cannot reserve: the group's script decides its keys together"
    } else if cost == 0 {
        "a reservation needs an estimate (cost) of at least 1"
    } else {
        return Ok(true);
    };
    Err(ApiError::invalid(field, refusal))
}

/// A key whose usage is read (`api::usage`): `{"policy", "key", "group"?}` at `prefix`,
/// resolved to the numbers the key is checked under (an override's, a runtime limit's).
/// A concurrency limit is refused: what it holds is in its leases' answers.
pub(crate) fn parse_usage(
    v: &Value,
    prefix: &str,
    policies: &Policies,
    caps: &Caps,
) -> Result<Check, ApiError> {
    let what = if prefix.is_empty() {
        "body"
    } else {
        prefix.trim_end_matches('.')
    };
    let obj = object(v, what)?;
    no_unknown_fields(obj, &["policy", "key", "group"], prefix)?;
    let base = policy(policies, obj, prefix)?;
    let key = key(obj, prefix, caps)?;
    let policy = policies.for_key(base, &key);
    let group = group(obj, prefix, &policy, caps)?;
    Ok(Check {
        policy,
        key,
        cost: 0,
        group,
        reserve: false,
    })
}

/// `POST /v1/usage`: `{"keys": [{"policy", "key", "group"?}, ...]}`, at least one and at
/// most `max_batch`.
pub(crate) fn parse_usage_batch(
    v: &Value,
    policies: &Policies,
    caps: &Caps,
) -> Result<Vec<Check>, ApiError> {
    let obj = object(v, "body")?;
    no_unknown_fields(obj, &["keys"], "")?;
    let Some(Value::Array(list)) = obj.get("keys") else {
        return Err(ApiError::invalid(
            "keys",
            "must be an array of {\"policy\", \"key\"} objects",
        ));
    };
    if list.is_empty() {
        return Err(ApiError::invalid("keys", "must not be empty"));
    }
    if list.len() > caps.max_batch {
        return Err(ApiError::BatchTooLarge {
            max: caps.max_batch,
            got: list.len(),
        });
    }
    list.iter()
        .enumerate()
        .map(|(i, k)| parse_usage(k, &format!("keys[{i}]."), policies, caps))
        .collect()
}

/// A parsed `POST /v1/charge` body: a cost counted after the work, without a
/// reservation; policies that take settlements, up to what they refill in a year.
pub(crate) fn parse_charge(v: &Value, policies: &Policies, caps: &Caps) -> Result<Check, ApiError> {
    let obj = object(v, "body")?;
    no_unknown_fields(obj, &["policy", "key", "cost"], "")?;
    let base = policy(policies, obj, "")?;
    let key = key(obj, "", caps)?;
    let policy = policies.for_key(base, &key);
    settling(&policy, "policy")?;
    if !obj.contains_key("cost") {
        return Err(ApiError::invalid(
            "cost",
            "missing field: the cost to charge",
        ));
    }
    let most = policy.max_settle_cost();
    let cost = units(obj, "cost", "", most, || {
        format!(
            "at most {most} (what policy \"{}\" refills in a year)",
            policy.name
        )
    })?;
    Ok(Check {
        policy,
        key,
        cost,
        group: None,
        reserve: false,
    })
}

/// A policy that can carry a debt (`settle_within`), or the error naming `field`.
fn settling(policy: &Policy, field: &str) -> Result<(), ApiError> {
    match policy.settle_within {
        Some(_) => Ok(()),
        None => Err(ApiError::invalid(
            field,
            format!(
                "policy \"{}\" takes no settlements (its settle_within is not set)",
                policy.name
            ),
        )),
    }
}

/// A parsed `POST /v1/settle` body: the check whose key holds the reservation (its cost
/// unused), the reservation, and the real cost.
pub(crate) fn parse_settle(
    v: &Value,
    policies: &Policies,
    caps: &Caps,
) -> Result<(Check, ReservationId, u64), ApiError> {
    let obj = object(v, "body")?;
    no_unknown_fields(obj, &["policy", "key", "reservation", "cost"], "")?;
    let base = policy(policies, obj, "")?;
    let key = key(obj, "", caps)?;
    let policy = policies.for_key(base, &key);
    settling(&policy, "policy")?;
    let text = string_field(obj, "reservation", "")?;
    let id = ReservationId::parse(text).ok_or_else(|| {
        ApiError::invalid(
            "reservation",
            format!(
                "must be the {} hex digits a reserving check returned",
                ReservationId::LEN
            ),
        )
    })?;
    if !obj.contains_key("cost") {
        return Err(ApiError::invalid("cost", "missing field: the real cost"));
    }
    let cost = units(obj, "cost", "", policy.max_settle_cost(), || {
        format!(
            "at most {} (what policy \"{}\" refills in a year)",
            policy.max_settle_cost(),
            policy.name
        )
    })?;
    let check = Check {
        policy,
        key,
        cost: 0,
        group: None,
        reserve: false,
    };
    Ok((check, id, cost))
}

/// The optional co-location group: a string like a key (it becomes a hash tag), for local
/// policies only.
fn group(
    obj: &Map<String, Value>,
    prefix: &str,
    policy: &Policy,
    caps: &Caps,
) -> Result<Option<String>, ApiError> {
    if !obj.contains_key("group") {
        return Ok(None);
    }
    let field = format!("{prefix}group");
    let group = string_field(obj, "group", prefix)?;
    if group.is_empty() {
        return Err(ApiError::invalid(field, "must not be empty"));
    }
    if group.len() > caps.max_key_bytes {
        return Err(ApiError::invalid(
            field,
            format!(
                "is {} bytes; at most {} allowed",
                group.len(),
                caps.max_key_bytes
            ),
        ));
    }
    if policy.global.is_some() {
        return Err(ApiError::invalid(
            field,
            format!(
                "policy \"{}\" is global: its keys live under the policy's own hash tag, so it takes no group",
                policy.name
            ),
        ));
    }
    Ok(Some(group.to_owned()))
}

/// A batch of one co-location group is decided by one script, once per key: the same
/// policy and key twice in it is refused (naming the second).
fn distinct_in_group(checks: &[Check]) -> Result<(), ApiError> {
    let Some(group) = checks.first().and_then(|c| c.group.as_deref()) else {
        return Ok(());
    };
    if checks.iter().any(|c| c.group.as_deref() != Some(group)) {
        return Ok(());
    }
    let mut seen = std::collections::HashSet::new();
    for (i, c) in checks.iter().enumerate() {
        if !seen.insert((c.policy.name.as_str(), c.key.as_str())) {
            return Err(ApiError::invalid(
                format!("checks[{i}].key"),
                "the same policy and key twice in one group; a group's batch decides each key once (send the summed cost)",
            ));
        }
    }
    Ok(())
}

impl CheckRequest {
    pub(crate) fn parse(
        v: &Value,
        policies: &Policies,
        caps: &Caps,
    ) -> Result<CheckRequest, ApiError> {
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
        let checks = list
            .iter()
            .enumerate()
            .map(|(i, c)| check(c, &format!("checks[{i}]."), policies, caps))
            .collect::<Result<Vec<_>, _>>()?;
        distinct_in_group(&checks)?;
        Ok(CheckRequest::Batch(checks))
    }
}

/// A parsed `POST /v1/reset` body.
pub(crate) fn parse_reset(v: &Value, policies: &Policies, caps: &Caps) -> Result<Reset, ApiError> {
    let obj = object(v, "body")?;
    // A concurrency limit's key: every lease given back (no group: it has none).
    if let Some(Value::String(name)) = obj.get("policy")
        && let Some(limit) = policies.concurrency(name)
    {
        no_unknown_fields(obj, &["policy", "key"], "")?;
        return Ok(Reset::Leases(limit.clone(), key(obj, "", caps)?));
    }
    no_unknown_fields(obj, &["policy", "key", "group"], "")?;
    let policy = policy(policies, obj, "")?.clone();
    let key = key(obj, "", caps)?;
    let group = group(obj, "", &policy, caps)?;
    Ok(Reset::Spent(policy, key, group))
}

/// What a `POST /v1/reset` forgets.
#[derive(Debug)]
pub(crate) enum Reset {
    /// What a rate policy's key (in its group, if any) spent.
    Spent(Arc<Policy>, String, Option<String>),
    /// Every lease a concurrency limit's key holds.
    Leases(Arc<ConcurrencyPolicy>, String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{FailMode, PolicySpec};
    use quotad_core::algorithm::Algorithm;
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
        let p = Policy::new(spec).unwrap();
        let caps = Caps {
            max_body_bytes: 1024,
            max_batch: 2,
            max_key_bytes: 8,
            body_timeout: Duration::from_secs(1),
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
    fn a_group_is_checked_like_a_key_and_names_each_key_once() {
        let field = |e: ApiError| match e {
            ApiError::InvalidRequest { field, .. } => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            field(err(json!({"policy": "api", "key": "k", "group": ""}))),
            "group"
        );
        assert_eq!(
            field(err(json!({"policy": "api", "key": "k", "group": 9}))),
            "group"
        );
        assert_eq!(
            field(err(
                json!({"policy": "api", "key": "k", "group": "123456789"})
            )),
            "group"
        );
        let twice = json!({"checks": [
            {"policy": "api", "key": "k", "group": "t"},
            {"policy": "api", "key": "k", "group": "t"},
        ]});
        assert_eq!(field(err(twice)), "checks[1].key");
        let (p, c) = setup();
        // The same key in different groups (or none) is two keys: fine.
        let mixed = json!({"checks": [
            {"policy": "api", "key": "k", "group": "t"},
            {"policy": "api", "key": "k"},
        ]});
        assert!(CheckRequest::parse(&mixed, &p, &c).is_ok());
        match CheckRequest::parse(&json!({"policy": "api", "key": "k", "group": "t"}), &p, &c) {
            Ok(CheckRequest::Single(check)) => assert_eq!(check.group.as_deref(), Some("t")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn duplicate_fields_are_refused_with_their_path() {
        let dup = |body: &str| match parse_json(body.as_bytes()) {
            Err(ApiError::InvalidRequest { field, .. }) => field,
            other => panic!("{body}: {other:?}"),
        };
        assert_eq!(dup(r#"{"key":"A","key":"B","cost":1,"cost":0}"#), "key");
        assert_eq!(
            dup(r#"{"checks":[{"policy":"a","key":"k"},{"policy":"a","key":"k","policy":"b"}]}"#),
            "checks[1].policy"
        );
        // Equal keys in different objects are fine; so is every JSON type.
        let v = parse_json(br#"{"a":{"x":1},"b":{"x":[true,null,1.5,-2,"s"]}}"#).unwrap();
        assert_eq!(v["b"]["x"][2], json!(1.5));
        assert!(matches!(
            parse_json(b"{\"a\":1} x"),
            Err(ApiError::InvalidJson(_))
        ));
        assert!(matches!(
            parse_json(b"{\"a\":"),
            Err(ApiError::InvalidJson(_))
        ));
    }

    #[test]
    fn cost_errors_name_the_real_problem() {
        let msg = |cost: &str| {
            let body = format!(r#"{{"policy":"api","key":"k","cost":{cost}}}"#);
            let (p, c) = setup();
            match CheckRequest::parse(&parse_json(body.as_bytes()).unwrap(), &p, &c) {
                Err(ApiError::InvalidRequest { field, message }) => {
                    assert_eq!(field, "cost");
                    message
                }
                other => panic!("{cost}: {other:?}"),
            }
        };
        assert!(msg("18446744073709551616").contains("too large"), "2^64");
        assert!(msg("1e300").contains("too large"));
        assert!(msg("-18446744073709551616").contains("negative"));
        assert!(msg("-1").contains("negative"));
        assert!(msg("2.5").contains("whole number"));
        assert!(msg("21").contains("exceeds the capacity 20"));
        assert!(msg("21.0").contains("exceeds the capacity 20"));
    }

    /// A whole number written as a float is that number (JSON Schema's integer): `1.0`
    /// and `1e1` are 1 and 10, `-0.0` is a peek. Both were "too large".
    #[test]
    fn a_whole_number_written_as_a_float_is_that_number() {
        let (p, c) = setup();
        for (text, want) in [
            ("1.0", 1),
            ("-0.0", 0),
            ("0.0", 0),
            ("1e1", 10),
            ("2.0e1", 20),
        ] {
            let body = format!(r#"{{"policy":"api","key":"k","cost":{text}}}"#);
            match CheckRequest::parse(&parse_json(body.as_bytes()).unwrap(), &p, &c) {
                Ok(CheckRequest::Single(ch)) => assert_eq!(ch.cost, want, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
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
