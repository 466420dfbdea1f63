//! What muster tells operators about its gangs: one line per gang (`kubectl muster
//! status`) and the live gauges of `/metrics`, both computed from the same caches the
//! operator plans from. Pure functions of the objects and the clock.

pub mod readings;
pub mod summary;
