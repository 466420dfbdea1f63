//! Node selection: node selectors (as in node affinity and ResourceSlices), node taints
//! and pod tolerations, with core/v1 semantics.

use std::collections::BTreeMap;

/// `NodeSelectorOperator`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
    Gt,
    Lt,
}

impl Operator {
    pub fn as_str(&self) -> &'static str {
        match self {
            Operator::In => "In",
            Operator::NotIn => "NotIn",
            Operator::Exists => "Exists",
            Operator::DoesNotExist => "DoesNotExist",
            Operator::Gt => "Gt",
            Operator::Lt => "Lt",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "In" => Operator::In,
            "NotIn" => Operator::NotIn,
            "Exists" => Operator::Exists,
            "DoesNotExist" => Operator::DoesNotExist,
            "Gt" => Operator::Gt,
            "Lt" => Operator::Lt,
            _ => return None,
        })
    }
}

/// `NodeSelectorRequirement`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    pub values: Vec<String>,
}

impl Requirement {
    pub fn new(key: &str, operator: Operator, values: &[&str]) -> Self {
        Requirement {
            key: key.into(),
            operator,
            values: values.iter().map(|v| v.to_string()).collect(),
        }
    }

    fn matches(&self, value: Option<&str>) -> bool {
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.iter().any(|x| x == v)),
            Operator::NotIn => value.is_none_or(|v| !self.values.iter().any(|x| x == v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
            Operator::Gt | Operator::Lt => {
                let (Some(actual), Some(bound)) = (
                    value.and_then(|v| v.parse::<i64>().ok()),
                    self.values.first().and_then(|v| v.parse::<i64>().ok()),
                ) else {
                    return false;
                };
                if self.operator == Operator::Gt {
                    actual > bound
                } else {
                    actual < bound
                }
            }
        }
    }

    /// Same key, operator and set of values (upstream deduplication of node selector
    /// requirements).
    pub fn equivalent(&self, other: &Requirement) -> bool {
        let mut a = self.values.clone();
        let mut b = other.values.clone();
        a.sort();
        a.dedup();
        b.sort();
        b.dedup();
        self.key == other.key && self.operator == other.operator && a == b
    }
}

/// `NodeSelectorTerm`: every requirement must hold.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Term {
    /// On node labels.
    pub match_expressions: Vec<Requirement>,
    /// On node fields; only `metadata.name` exists.
    pub match_fields: Vec<Requirement>,
}

impl Term {
    /// A term with no requirements matches no node (upstream).
    pub fn matches(&self, node_name: &str, labels: &BTreeMap<String, String>) -> bool {
        if self.match_expressions.is_empty() && self.match_fields.is_empty() {
            return false;
        }
        self.match_expressions
            .iter()
            .all(|r| r.matches(labels.get(&r.key).map(String::as_str)))
            && self
                .match_fields
                .iter()
                .all(|r| r.matches((r.key == "metadata.name").then_some(node_name)))
    }
}

/// `NodeSelector`: at least one term must hold.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct NodeSelector {
    pub terms: Vec<Term>,
}

impl NodeSelector {
    /// The selector of exactly one node, as an allocation of node-local devices has.
    pub fn for_node(node: &str) -> Self {
        NodeSelector {
            terms: vec![Term {
                match_expressions: vec![],
                match_fields: vec![Requirement::new("metadata.name", Operator::In, &[node])],
            }],
        }
    }

    pub fn matches(&self, node_name: &str, labels: &BTreeMap<String, String>) -> bool {
        self.terms.iter().any(|t| t.matches(node_name, labels))
    }
}

/// Effect of a node taint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeTaintEffect {
    NoSchedule,
    PreferNoSchedule,
    NoExecute,
}

/// A node taint.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Taint {
    pub key: String,
    pub value: String,
    pub effect: NodeTaintEffect,
}

/// A pod toleration.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Toleration {
    /// Empty with `exists`: tolerates every taint.
    pub key: String,
    /// Operator Exists (true) or Equal (false).
    pub exists: bool,
    pub value: String,
    /// `None` tolerates every effect.
    pub effect: Option<NodeTaintEffect>,
}

impl Toleration {
    /// core/v1 `Toleration.ToleratesTaint`.
    pub fn tolerates(&self, taint: &Taint) -> bool {
        if self.effect.is_some_and(|e| e != taint.effect) {
            return false;
        }
        if !self.key.is_empty() && self.key != taint.key {
            return false;
        }
        self.exists || self.value == taint.value
    }
}

/// Whether every NoSchedule and NoExecute taint is tolerated (the scheduler's
/// TaintToleration filter; PreferNoSchedule only affects scoring).
pub fn tolerates_all(tolerations: &[Toleration], taints: &[Taint]) -> bool {
    taints
        .iter()
        .filter(|t| t.effect != NodeTaintEffect::PreferNoSchedule)
        .all(|t| tolerations.iter().any(|tol| tol.tolerates(t)))
}

/// The first taint that is not tolerated, for explanations.
pub fn untolerated<'a>(tolerations: &[Toleration], taints: &'a [Taint]) -> Option<&'a Taint> {
    taints
        .iter()
        .filter(|t| t.effect != NodeTaintEffect::PreferNoSchedule)
        .find(|t| !tolerations.iter().any(|tol| tol.tolerates(t)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn requirements_and_terms() {
        let l = labels(&[("rack", "r1"), ("gen", "5")]);
        let term = |reqs: Vec<Requirement>| Term {
            match_expressions: reqs,
            match_fields: vec![],
        };
        assert!(term(vec![Requirement::new("rack", Operator::In, &["r1", "r2"])]).matches("n", &l));
        assert!(!term(vec![Requirement::new("rack", Operator::NotIn, &["r1"])]).matches("n", &l));
        assert!(
            term(vec![Requirement::new("zone", Operator::NotIn, &["a"])]).matches("n", &l),
            "absent label is not in"
        );
        assert!(term(vec![Requirement::new("gen", Operator::Gt, &["4"])]).matches("n", &l));
        assert!(!term(vec![Requirement::new("gen", Operator::Lt, &["4"])]).matches("n", &l));
        assert!(
            !term(vec![Requirement::new("rack", Operator::Gt, &["1"])]).matches("n", &l),
            "non-integer"
        );
        assert!(term(vec![Requirement::new("zone", Operator::DoesNotExist, &[])]).matches("n", &l));
        assert!(!Term::default().matches("n", &l), "empty term matches nothing");
        assert!(NodeSelector::for_node("n").matches("n", &l));
        assert!(!NodeSelector::for_node("n").matches("m", &l));
        assert!(!NodeSelector::default().matches("n", &l));
    }

    #[test]
    fn taints_and_tolerations() {
        let taint = Taint {
            key: "gpu".into(),
            value: "true".into(),
            effect: NodeTaintEffect::NoSchedule,
        };
        let soft = Taint {
            key: "soft".into(),
            value: String::new(),
            effect: NodeTaintEffect::PreferNoSchedule,
        };
        let equal = Toleration {
            key: "gpu".into(),
            exists: false,
            value: "true".into(),
            effect: None,
        };
        let wildcard = Toleration {
            key: String::new(),
            exists: true,
            value: String::new(),
            effect: None,
        };
        let wrong_effect = Toleration {
            key: "gpu".into(),
            exists: true,
            value: String::new(),
            effect: Some(NodeTaintEffect::NoExecute),
        };
        assert!(tolerates_all(
            std::slice::from_ref(&equal),
            &[taint.clone(), soft.clone()]
        ));
        assert!(tolerates_all(&[wildcard], std::slice::from_ref(&taint)));
        assert!(!tolerates_all(&[wrong_effect], std::slice::from_ref(&taint)));
        assert!(tolerates_all(&[], std::slice::from_ref(&soft)));
        assert_eq!(untolerated(&[], std::slice::from_ref(&taint)), Some(&taint));
    }
}
