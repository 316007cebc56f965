//! See docs/security.md.
