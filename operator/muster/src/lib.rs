//! The muster operator: conversions between Kubernetes objects and the engine, the
//! controllers, and the command-line interface.
#![forbid(unsafe_code)]

pub mod admission;
pub mod cache;
pub mod cli;
pub mod client;
pub mod controller;
pub mod convert;
#[cfg(feature = "demo")]
pub mod demo;
pub mod extras;
pub mod faults;
pub mod fencing;
pub mod gang;
pub mod gang_index;
pub mod index;
pub mod kueue;
pub mod kueue_status;
pub mod leader;
pub mod membership;
pub mod metrics;
pub mod names;
pub mod objects;
pub mod observe;
pub mod pacing;
pub mod plan;
pub mod release;
pub mod rendezvous;
pub mod request;
pub mod runtime;
pub mod serve;
pub mod status;
