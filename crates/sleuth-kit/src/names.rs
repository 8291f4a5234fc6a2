//! Names that callers choose and the mesh then uses as keys and paths (run
//! ids in Redis keys, SQL rows and checkpoint folders): checked once where
//! they enter, so no later use can be steered outside its place.

use crate::error::KitError;

/// Longest name accepted.
pub const MAX_NAME_LEN: usize = 128;

/// Checks that `value` (the `field` of a request or configuration) is a
/// plain name: 1 to 128 of `A-Z a-z 0-9 . _ -`, not starting with a dot.
pub fn check_name(field: &'static str, value: &str) -> Result<(), KitError> {
    let invalid = |message: String| KitError::Config { field, message };
    if value.is_empty() || value.len() > MAX_NAME_LEN {
        return Err(invalid(format!("{value:?} must have 1 to {MAX_NAME_LEN} characters")));
    }
    if value.starts_with('.') {
        return Err(invalid(format!("{value:?} must not start with a dot")));
    }
    match value.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        Some(c) => Err(invalid(format!("{value:?} holds {c:?}; use letters, digits, '.', '_' and '-'"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_names_pass_and_others_are_named() {
        for good in ["run-1", "sft.2026_12", "A"] {
            assert!(check_name("run_id", good).is_ok(), "{good}");
        }
        for bad in ["", "..", ".hidden", "a/b", "a b", "runé", &"x".repeat(129)] {
            let error = check_name("run_id", bad).unwrap_err().to_string();
            assert!(error.contains("run_id"), "{bad}: {error}");
        }
    }
}
