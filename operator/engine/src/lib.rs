//! muster's placement engine: pure and synchronous. It holds its own model of the
//! cluster, takes a gang request and returns a plan or the reasons it does not fit,
//! and, for a gang that does not fit, which gangs of lower priority to evict.
//! It never talks to Kubernetes and never reads the clock.
#![forbid(unsafe_code)]

// Device selectors, and the quantities and attribute maps they read, are their own crate;
// the engine's model is built from them.
pub use muster_cel as cel;
pub use muster_cel::{name_map, quantity};

pub mod allocator;
pub mod claim;
pub mod cluster;
pub mod device;
#[cfg(feature = "fixtures")]
pub mod fixtures;
pub mod key;
pub mod labels;
mod ledger;
pub mod placement;
pub mod pod;
pub mod pools;
pub mod preemption;
pub mod request;
pub mod resources;
pub mod selector;
pub mod storage;
