//! The Workload controller and what a Workload stands for: its gated pods, claims and
//! headless Service, which pods make up its groups, how they find each other, and the
//! status it reports.

pub mod admitted;
pub mod charge;
pub mod controller;
pub mod extended;
pub mod gang;
pub mod membership;
pub mod names;
pub mod observe;
pub mod pacing;
pub mod rendezvous;
pub mod status;
pub mod terminating;
