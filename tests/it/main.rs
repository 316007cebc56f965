//! Integration tests: each drives a real `meshgate` process over HTTP.

mod acme;
mod api;
mod chain;
mod cli;
#[cfg(feature = "cluster")]
mod cluster;
#[cfg(feature = "cluster")]
mod cluster_history;
#[cfg(feature = "cluster")]
mod cluster_members;
mod common;
mod dashboard;
mod deploy;
mod docs;
#[cfg(feature = "cluster")]
mod etcd;
/// A real etcd for the cluster tests (shared with the store's unit tests).
#[cfg(feature = "cluster")]
#[path = "../../src/storage/etcd_process.rs"]
mod etcd_process;
mod export;
mod functions;
mod grpc;
mod history;
mod node;
mod observe;
mod openapi;
mod paging;
mod passivate;
mod pubsub;
mod quotas;
mod security;
mod sessions;
mod single_node;
mod telemetry;
mod upgrade;
