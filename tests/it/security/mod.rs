//! The security suite: every attack of docs/security.md as a test, driven
//! end to end against real nodes, plus property passes over the parsers that
//! take untrusted bytes. Each module is one trust boundary.

mod attack;
mod bounds;
mod dashboard;
mod egress;
mod hop;
mod hosts;
mod input;
mod ledger;
mod limits;
mod metrics;
mod paths;
mod records;
mod seals;
mod secrets;
mod siwe;
mod wallet;
