//! Integration tests: each drives a real `meshgate` process over HTTP.

mod chain;
#[cfg(feature = "cluster")]
mod cluster;
mod common;
mod dashboard;
mod deploy;
#[cfg(feature = "cluster")]
mod etcd;
mod functions;
mod node;
mod pubsub;
