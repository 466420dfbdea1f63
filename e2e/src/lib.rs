//! muster's end-to-end tests' shared pieces, on the local control plane of
//! `muster-local-cluster`: the Helm chart rendered, the chart's RBAC, scenarios of gangs,
//! the invariants every test checks, storage the tests make, and a seeded generator.

pub mod chart;
pub mod frameworks;
pub mod invariants;
pub mod rbac;
pub mod rng;
pub mod scenario;
pub mod storage;
pub mod testing;
