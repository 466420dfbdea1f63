//! muster's placement engine: pure and synchronous. It holds its own model of the
//! cluster, takes a gang request and returns a plan or the reasons it does not fit.
//! It never talks to Kubernetes and never reads the clock.
#![forbid(unsafe_code)]

pub mod allocator;
pub mod cel;
pub mod claim;
pub mod cluster;
pub mod device;
pub mod fixtures;
mod fxhash;
pub mod name_map;
pub mod placement;
pub mod pools;
pub mod quantity;
pub mod request;
pub mod resources;
pub mod selector;
