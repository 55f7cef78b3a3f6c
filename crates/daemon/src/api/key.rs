//! Keys made of several parts (forward-auth's sources, an Envoy descriptor's entry
//! values): the one place that joins them.
//!
//! Parts are joined with `|`, each part's own `\` and `|` escaped with a backslash, so the
//! joined key names its parts unambiguously: `user = "free|ann"` and `plan = "free", user =
//! "ann"` are two keys, however a client chooses its values. A part without `|` or `\`
//! (nearly every real value) is written as is, so such keys read as before and an
//! override names them as they look (`free|ann` for the parts `free` and `ann`).

/// The separator between parts.
pub(crate) const SEPARATOR: char = '|';

/// `parts` joined with [`SEPARATOR`], each escaped.
pub(crate) fn join<'a>(parts: impl IntoIterator<Item = &'a str>) -> String {
    let mut key = String::new();
    for (i, part) in parts.into_iter().enumerate() {
        if i > 0 {
            key.push(SEPARATOR);
        }
        for c in part.chars() {
            if c == '\\' || c == SEPARATOR {
                key.push('\\');
            }
            key.push(c);
        }
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_value_can_pose_as_two_parts() {
        assert_eq!(join(["free", "ann"]), "free|ann");
        assert_eq!(join(["free|ann"]), "free\\|ann");
        assert_ne!(join(["free|ann"]), join(["free", "ann"]));
        assert_ne!(join(["a\\", "b"]), join(["a\\|b"]));
        assert_eq!(join(["a\\", "b"]), "a\\\\|b");
        assert_eq!(
            join(["203.0.113.7"]),
            "203.0.113.7",
            "plain values as written"
        );
    }
}
