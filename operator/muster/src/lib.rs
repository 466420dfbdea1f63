//! The muster operator. Its tree follows the path of a gang:
//!
//! - [`cache`]: watches and indexes — the gang objects by Workload, and the engine's
//!   model of the cluster that planners read as a snapshot;
//! - [`workload`]: the Workload controller — a gang's pods, claims and Service, its
//!   membership, rendezvous and status;
//! - [`admission`]: the admission loop — plans gangs with the engine, reserves their
//!   claims, releases their pods, gives devices back; and what it tells Kueue;
//! - [`frameworks`]: JobSets, TrainJobs and Jobs that become gangs with one label;
//! - [`webhook`]: the admission webhook that gates their pods, and its certificate;
//! - [`kueue`]: Kueue's external-framework protocol;
//! - [`convert`] and [`snapshot`]: Kubernetes objects in the engine's terms, from the
//!   API server or from files;
//! - [`kube_ops`]: the Kubernetes operations several of the above share;
//! - [`ops`]: the client, metrics, health endpoints, leader election and fault hooks;
//! - [`report`]: what muster tells operators about its gangs (status lines, live gauges);
//! - [`cli`]: `muster run`, `plan`, `crd` and `demo`.
#![forbid(unsafe_code)]

pub mod admission;
pub mod cache;
pub mod cli;
pub mod convert;
pub mod frameworks;
pub mod kube_ops;
pub mod kueue;
pub mod ops;
pub mod owners;
pub mod report;
pub mod snapshot;
pub mod uninstall;
pub mod webhook;
pub mod workload;
