//! The muster operator: conversions between Kubernetes objects and the engine, the
//! controllers, and the command-line interface.
#![forbid(unsafe_code)]

pub mod cli;
pub mod controller;
pub mod convert;
#[cfg(feature = "demo")]
pub mod demo;
pub mod gang;
pub mod objects;
pub mod plan;
pub mod request;
pub mod status;
