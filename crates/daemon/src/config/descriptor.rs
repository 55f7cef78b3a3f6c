//! `[[descriptor]]`: Envoy rate-limit descriptors (what Envoy's `rate_limits` actions send
//! to `ShouldRateLimit`) mapped to quotad policies, in the shape of envoyproxy/ratelimit's
//! `descriptors:` tree. The gRPC side is `api::grpc`.
//!
//! ```toml
//! [[descriptor]]
//! domain = "edge"
//! key = "remote_address"        # any value: one key per address
//! policy = "per_ip"
//!
//! [[descriptor]]
//! domain = "edge"
//! key = "plan"
//! value = "free"                # only this value
//!   [[descriptor.descriptor]]   # the request's next entry, under plan=free
//!   key = "user"
//!   policy = "free_user"
//! ```
//!
//! A value ending in `*` (`value = "api-*"`) matches every value with that prefix, as in
//! envoyproxy/ratelimit; each matching value is its own quotad key, as with no value.
//!
//! A node with `charge = true` is counted after the work (Envoy's response path,
//! `apply_on_stream_done`, with the real cost as its `hits_addend`): its hits are charged
//! whether or not the key has them, the key going into debt, and never denied; a hit of
//! 0 is a peek, denied while the key is in debt (what the request path sends). Its policy
//! must take settlements (`settle_within`).
//!
//! A request descriptor's entries walk the tree level by level: at each level the node with
//! the entry's key and exact value wins, else the one whose wildcard value is the longest
//! prefix of it, else the node with the key and no value; the node the last entry lands
//! on names the policy. No node, or a node without a policy: not limited.

use std::collections::HashMap;

use toml::Spanned;

use super::{Validator, raw};

/// One node of a descriptor tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DescriptorNode {
    pub(crate) key: String,
    /// `None`: any value (each value is its own quotad key). A value ending in `*`: any
    /// value with the prefix before it (likewise).
    pub(crate) value: Option<String>,
    /// The policy of a request descriptor that ends here; `None`: not limited.
    pub(crate) policy: Option<String>,
    /// Its hits are charged, never denied (see the module docs).
    pub(crate) charge: bool,
    pub(crate) children: Vec<DescriptorNode>,
}

/// The policies a descriptor may name, and those it may charge.
struct Names<'a> {
    policies: &'a [&'a str],
    settling: &'a [&'a str],
    /// Concurrency limits: named by no descriptor (Envoy cannot release a lease).
    concurrency: &'a [&'a str],
}

/// A level's `(key, value)` pairs so far (duplicates are errors).
type Seen = (String, Option<String>);

/// The descriptor trees by domain.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Descriptors {
    domains: HashMap<String, Vec<DescriptorNode>>,
}

impl Descriptors {
    /// How many domains have descriptors.
    pub(crate) fn len(&self) -> usize {
        self.domains.len()
    }

    /// The policy a request descriptor (its entries as `(key, value)`) is limited by, if
    /// any. Unknown domains and unmatched entries are not limited.
    #[cfg(test)]
    fn policy_of<'a, 'e>(
        &'a self,
        domain: &str,
        entries: impl IntoIterator<Item = (&'e str, &'e str)>,
    ) -> Option<&'a str> {
        self.matched(domain, entries).map(|m| m.policy)
    }

    /// What a request descriptor lands on: its policy, and whether it is charged.
    pub(crate) fn matched<'a, 'e>(
        &'a self,
        domain: &str,
        entries: impl IntoIterator<Item = (&'e str, &'e str)>,
    ) -> Option<Matched<'a>> {
        let mut level = self.domains.get(domain)?.as_slice();
        let mut node = None;
        for (key, value) in entries {
            let n = level
                .iter()
                .filter(|n| n.key == key)
                .filter_map(|n| Some((n.matches(value)?, n)))
                .max_by_key(|(rank, _)| *rank)?
                .1;
            level = &n.children;
            node = Some(n);
        }
        let node = node?;
        Some(Matched {
            policy: node.policy.as_deref()?,
            charge: node.charge,
        })
    }
}

/// The node a request descriptor landed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Matched<'a> {
    pub(crate) policy: &'a str,
    /// Charged on the response path, never denied.
    pub(crate) charge: bool,
}

/// How well a node matches a value, best highest: exact beats a longer wildcard prefix
/// beats a shorter one beats any value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Rank {
    Any,
    Prefix(usize),
    Exact,
}

impl DescriptorNode {
    fn matches(&self, value: &str) -> Option<Rank> {
        match self.value.as_deref() {
            None => Some(Rank::Any),
            Some(v) => match v.strip_suffix('*') {
                Some(prefix) => value
                    .starts_with(prefix)
                    .then_some(Rank::Prefix(prefix.len())),
                None => (v == value).then_some(Rank::Exact),
            },
        }
    }
}

impl Validator<'_> {
    /// Every `[[descriptor]]` tree; `policies` are the names `[[policy]]` defines.
    pub(super) fn descriptors(
        &mut self,
        raw: &[raw::Descriptor],
        policies: &[&str],
        settling: &[&str],
        concurrency: &[&str],
    ) -> Descriptors {
        let mut domains: HashMap<String, Vec<DescriptorNode>> = HashMap::new();
        let mut seen: HashMap<String, Vec<Seen>> = HashMap::new();
        for (i, d) in raw.iter().enumerate() {
            let field = format!("descriptor[{i}]");
            let domain = match &d.domain {
                Some(dom) if !dom.get_ref().is_empty() => dom.get_ref().clone(),
                Some(dom) => {
                    self.error(dom, &format!("{field}.domain"), "must not be empty");
                    continue;
                }
                None => {
                    self.error(
                        &d.key,
                        &format!("{field}.domain"),
                        "a top-level descriptor needs its domain (what Envoy's rate limit filter sends as `domain`)",
                    );
                    continue;
                }
            };
            let names = Names {
                policies,
                settling,
                concurrency,
            };
            let node =
                self.descriptor_node(d, &field, &names, seen.entry(domain.clone()).or_default());
            if let Some(node) = node {
                domains.entry(domain).or_default().push(node);
            }
        }
        Descriptors { domains }
    }

    /// One node and its children; `None` (with the errors recorded) if any is wrong.
    fn descriptor_node(
        &mut self,
        d: &raw::Descriptor,
        field: &str,
        names: &Names<'_>,
        seen: &mut Vec<Seen>,
    ) -> Option<DescriptorNode> {
        let before = self.errors.len();
        let key = d.key.get_ref().clone();
        if key.is_empty() {
            self.error(&d.key, &format!("{field}.key"), "must not be empty");
        }
        let value = d.value.as_ref().map(|v| v.get_ref().clone());
        if let Some(v) = &d.value {
            self.descriptor_value(v, field);
        }
        let this = (key.clone(), value.clone());
        if seen.contains(&this) {
            let what = match &value {
                Some(v) => format!("key \"{key}\" with value \"{v}\""),
                None => format!("key \"{key}\" without a value"),
            };
            let why = format!("{what} is already a descriptor at this level");
            self.error(&d.key, &format!("{field}.key"), why);
        } else {
            seen.push(this);
        }
        let policy = d
            .policy
            .as_ref()
            .and_then(|p| self.descriptor_policy(p, field, names));
        let charge = d.charge.as_ref().is_some_and(|c| *c.get_ref());
        if let Some(c) = d.charge.as_ref().filter(|c| *c.get_ref()) {
            self.descriptor_charge(c, d, policy.as_deref(), field, names);
        }
        if d.policy.is_none() && d.descriptor.is_empty() {
            let why =
                "names no policy and holds no [[descriptor.descriptor]]: it would limit nothing";
            self.error(&d.key, &format!("{field}.policy"), why);
        }
        let mut children: Vec<DescriptorNode> = Vec::new();
        let mut seen_children = Vec::new();
        for (j, c) in d.descriptor.iter().enumerate() {
            let cfield = format!("{field}.descriptor[{j}]");
            if let Some(dom) = &c.domain {
                let why = "only a top-level descriptor names a domain";
                self.error(dom, &format!("{cfield}.domain"), why);
            }
            if let Some(node) = self.descriptor_node(c, &cfield, names, &mut seen_children) {
                children.push(node);
            }
        }
        (self.errors.len() == before).then_some(DescriptorNode {
            key,
            value,
            policy,
            charge,
            children,
        })
    }

    /// A node's value: not empty, not `*` alone, a `*` only at its end.
    fn descriptor_value(&mut self, v: &Spanned<String>, field: &str) {
        let text = v.get_ref();
        let why = if text.is_empty() || text == "*" {
            Some("must not be empty or \"*\" (leave it out to match any value)")
        } else if text.trim_end_matches('*').contains('*') || text.ends_with("**") {
            Some("a `*` may only end the value (a prefix wildcard, e.g. \"api-*\")")
        } else {
            None
        };
        if let Some(why) = why {
            self.error(v, &format!("{field}.value"), why);
        }
    }

    /// A charged node (`charge = c`): its policy (`policy`, as resolved) is on the same
    /// node and takes settlements.
    fn descriptor_charge(
        &mut self,
        c: &Spanned<bool>,
        d: &raw::Descriptor,
        policy: Option<&str>,
        field: &str,
        names: &Names<'_>,
    ) {
        let why = match policy {
            None if d.policy.is_none() => {
                Some("a charged descriptor needs its policy on the same node".to_owned())
            }
            Some(p) if !names.settling.contains(&p) => Some(format!(
                "policy \"{p}\" takes no settlements: a charge needs a policy that can carry a debt (set its settle_within)"
            )),
            _ => None,
        };
        if let Some(why) = why {
            self.error(c, &format!("{field}.charge"), why);
        }
    }

    fn descriptor_policy(
        &mut self,
        p: &Spanned<String>,
        field: &str,
        names: &Names<'_>,
    ) -> Option<String> {
        let name = p.get_ref().as_str();
        if names.concurrency.contains(&name) {
            let why = format!(
                "\"{name}\" is a concurrency limit: Envoy's rate-limit calls name no lease to release, so a descriptor cannot hold one; acquire and release it from the service (docs/envoy.md)"
            );
            self.error(p, &format!("{field}.policy"), why);
            return None;
        }
        if names.policies.contains(&name) {
            return Some(p.get_ref().clone());
        }
        let why = format!(
            "unknown policy \"{}\"; define it with [[policy]]",
            p.get_ref()
        );
        self.error(p, &format!("{field}.policy"), why);
        None
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Settings;

    const POLICIES: &str = "[[policy]]\nname = \"a\"\nalgorithm = \"gcra\"\nlimit = 10\nwindow = \"1s\"\n[[policy]]\nname = \"b\"\nalgorithm = \"gcra\"\nlimit = 5\nwindow = \"1m\"\n";

    #[test]
    fn entries_walk_the_tree_value_before_wildcard() {
        let src = format!(
            "{POLICIES}[[descriptor]]\ndomain = \"d\"\nkey = \"k\"\npolicy = \"a\"\n[[descriptor]]\ndomain = \"d\"\nkey = \"k\"\nvalue = \"vip\"\n[[descriptor.descriptor]]\nkey = \"user\"\npolicy = \"b\"\n"
        );
        let s = Settings::parse("t.toml", &src).unwrap_or_else(|e| panic!("{e}"));
        let d = &s.descriptors;
        assert_eq!(d.policy_of("d", [("k", "x")]), Some("a"));
        assert_eq!(d.policy_of("d", [("k", "vip")]), None, "no policy on vip");
        assert_eq!(d.policy_of("d", [("k", "vip"), ("user", "u1")]), Some("b"));
        assert_eq!(d.policy_of("d", [("k", "x"), ("user", "u1")]), None);
        assert_eq!(d.policy_of("other", [("k", "x")]), None);
        assert_eq!(d.policy_of("d", [("nope", "x")]), None);
        assert_eq!(d.policy_of("d", []), None);
    }

    #[test]
    fn a_wildcard_value_matches_its_prefix_exact_and_longer_prefixes_first() {
        let node = |value: &str, policy: &str| {
            format!(
                "[[descriptor]]\ndomain = \"d\"\nkey = \"path\"\nvalue = \"{value}\"\npolicy = \"{policy}\"\n"
            )
        };
        let src = format!(
            "{POLICIES}{}{}{}[[descriptor]]\ndomain = \"d\"\nkey = \"path\"\npolicy = \"b\"\n",
            node("/api/*", "a"),
            node("/api/admin/*", "b"),
            node("/api/health", "b"),
        );
        let s = Settings::parse("t.toml", &src).unwrap_or_else(|e| panic!("{e}"));
        let d = &s.descriptors;
        let path = |p: &'static str| d.policy_of("d", [("path", p)]);
        assert_eq!(path("/api/users"), Some("a"));
        assert_eq!(path("/api/"), Some("a"), "an empty rest matches");
        assert_eq!(path("/api/admin/x"), Some("b"), "the longer prefix");
        assert_eq!(path("/api/health"), Some("b"), "exact first");
        assert_eq!(path("/other"), Some("b"), "no value: anything else");
    }

    #[test]
    fn a_star_only_ends_a_value() {
        for bad in ["*", "a*b", "a**", "*a"] {
            let src = format!(
                "{POLICIES}[[descriptor]]\ndomain = \"d\"\nkey = \"k\"\nvalue = \"{bad}\"\npolicy = \"a\"\n"
            );
            let e = Settings::parse("t.toml", &src).unwrap_err().to_string();
            assert!(e.contains("descriptor[0].value"), "{bad}: {e}");
        }
    }

    #[test]
    fn errors_name_the_line_and_the_nested_field() {
        let src = format!(
            "{POLICIES}[[descriptor]]\nkey = \"k\"\npolicy = \"a\"\n[[descriptor]]\ndomain = \"d\"\nkey = \"k\"\n[[descriptor.descriptor]]\ndomain = \"x\"\nkey = \"u\"\npolicy = \"zzz\"\n[[descriptor.descriptor]]\nkey = \"u\"\nvalue = \"\"\n"
        );
        let e = Settings::parse("t.toml", &src).unwrap_err().to_string();
        let lines: Vec<&str> = e.lines().collect();
        assert_eq!(
            lines,
            [
                "t.toml:12: descriptor[0].domain: a top-level descriptor needs its domain (what Envoy's rate limit filter sends as `domain`)",
                "t.toml:18: descriptor[1].descriptor[0].domain: only a top-level descriptor names a domain",
                "t.toml:20: descriptor[1].descriptor[0].policy: unknown policy \"zzz\"; define it with [[policy]]",
                "t.toml:22: descriptor[1].descriptor[1].policy: names no policy and holds no [[descriptor.descriptor]]: it would limit nothing",
                "t.toml:23: descriptor[1].descriptor[1].value: must not be empty or \"*\" (leave it out to match any value)",
            ],
            "{e}"
        );
    }
}
