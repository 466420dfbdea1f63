//! CEL device selectors, evaluated as kube-scheduler evaluates them.
