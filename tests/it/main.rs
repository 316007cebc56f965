//! Integration tests: each drives a real `meshgate` process over HTTP.

mod chain;
mod common;
mod dashboard;
#[cfg(feature = "cluster")]
mod etcd;
mod functions;
mod node;
mod pubsub;
