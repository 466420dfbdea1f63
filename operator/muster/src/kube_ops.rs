//! Kubernetes operations several parts of muster share.
