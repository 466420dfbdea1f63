//! Running the operator: the Kubernetes client, metrics, health endpoints, leader
//! election, and the fault hooks the tests use.

pub mod client;
pub mod faults;
pub mod leader;
pub mod metrics;
pub mod serve;
