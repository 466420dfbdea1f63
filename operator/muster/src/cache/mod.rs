//! What muster knows of the cluster, from watches: the gang objects indexed by Workload,
//! and the engine's model of the cluster that planners read as a snapshot.

pub mod cluster;
pub mod gang_index;
pub mod gang_objects;
pub mod touched;
