//! Which gangs a preemptor may evict: any, those of its own namespace, or none.

/// The values of `--preemption-scope`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PreemptionScope {
    /// Gangs of lower priority in any namespace.
    #[default]
    Cluster,
    /// Only gangs in the preemptor's own namespace: a tenant's priority never reaches
    /// another tenant's gangs.
    Namespace,
    /// No preemption at all, for example where Kueue owns queueing and preemption.
    Off,
}

impl PreemptionScope {
    /// Whether a gang in `preemptor` may evict one in `victim` (namespaces).
    pub fn allows(self, preemptor: &str, victim: &str) -> bool {
        match self {
            PreemptionScope::Cluster => true,
            PreemptionScope::Namespace => preemptor == victim,
            PreemptionScope::Off => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_scope_reaches_what_it_names() {
        assert!(PreemptionScope::Cluster.allows("a", "b"));
        assert!(PreemptionScope::Namespace.allows("a", "a"));
        assert!(!PreemptionScope::Namespace.allows("a", "b"));
        assert!(!PreemptionScope::Off.allows("a", "a"));
    }
}
