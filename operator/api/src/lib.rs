//! The muster.dev API: the `Workload` custom resource, the names muster uses on the
//! objects it manages, condition reasons, and the CRD generator.
#![forbid(unsafe_code)]

pub mod conditions;
pub mod crd;
pub mod labels;
pub mod v1alpha1;
pub mod validation;

pub use v1alpha1::{Workload, WorkloadSpec, WorkloadStatus};
