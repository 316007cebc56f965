//! Integration tests: each drives a real `meshgate` process over HTTP.

mod common;
mod dashboard;
mod node;
