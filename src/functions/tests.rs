//! Unit tests of the functions module's pure parts.

use super::model::{parse_cron, topic_matches, valid_function_name};
use super::secrets::SecretBox;

/// Topic globs: `*` any run, `?` one character, the rest literal.
#[test]
fn functions_topic_globs() {
    assert!(topic_matches("orders.*", "orders.new"));
    assert!(topic_matches("orders.*", "orders."));
    assert!(!topic_matches("orders.*", "order.new"));
    assert!(topic_matches("*", "anything"));
    assert!(topic_matches("a?c", "abc"));
    assert!(!topic_matches("a?c", "ac"));
    assert!(topic_matches("a*b*c", "axxbyyc"));
    assert!(!topic_matches("a*b*c", "axxbyy"));
    assert!(topic_matches("exact", "exact"));
    // A literal `*` in the topic does not use up the pattern's wildcard.
    assert!(topic_matches("*x", "*ax"));
}

/// Cron takes 5 or 6 fields and refuses the rest.
#[test]
fn functions_cron_fields() {
    assert!(parse_cron("*/5 * * * *").is_ok());
    assert!(parse_cron("*/2 * * * * *").is_ok());
    assert!(parse_cron("* * * *").is_err());
    assert!(parse_cron("61 * * * *").is_err());
}

/// Names are lowercase, digits, `-` and `_`.
#[test]
fn functions_names() {
    assert!(valid_function_name("echo-1_a"));
    assert!(!valid_function_name("Echo"));
    assert!(!valid_function_name("-x"));
    assert!(!valid_function_name("a/b"));
    assert!(!valid_function_name(""));
}

/// A sealed secret opens under its own key only, and never shows the clear text.
#[test]
fn functions_secret_sealing() {
    let b = SecretBox::new(&[7u8; 32]);
    let s = b.seal(b"secret/a/TOKEN", b"hunter2");
    assert!(!s.windows(7).any(|w| w == b"hunter2"));
    assert_eq!(
        b.open(b"secret/a/TOKEN", &s).as_deref(),
        Some(&b"hunter2"[..])
    );
    assert_eq!(b.open(b"secret/b/TOKEN", &s), None);
    assert_eq!(SecretBox::new(&[8u8; 32]).open(b"secret/a/TOKEN", &s), None);
}
