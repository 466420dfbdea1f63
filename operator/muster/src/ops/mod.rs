//! Running the operator: the Kubernetes client, metrics, health endpoints, leader
//! election, retry backoff, and the fault hooks the tests use.

pub mod backoff;
pub mod client;
pub mod faults;
pub mod leader;
pub mod metrics;
pub mod serve;
