//! Label selectors (`metav1.LabelSelector`) as `labels.Selector` evaluates them: on pod
//! labels for inter-pod affinity and topology spread, on namespace labels for affinity
//! terms' namespace selectors, and on PersistentVolume labels for a claim's selector.

use std::collections::BTreeMap;
use std::fmt;

/// A label selector's operator. `matchLabels` entries are `In` with one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LabelOperator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

/// One requirement of a label selector.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabelRequirement {
    pub key: String,
    pub operator: LabelOperator,
    pub values: Vec<String>,
}

impl LabelRequirement {
    pub fn new(key: &str, operator: LabelOperator, values: &[&str]) -> Self {
        LabelRequirement {
            key: key.to_string(),
            operator,
            values: values.iter().map(|v| v.to_string()).collect(),
        }
    }

    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            LabelOperator::In => value.is_some_and(|v| self.values.contains(v)),
            LabelOperator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            LabelOperator::Exists => value.is_some(),
            LabelOperator::DoesNotExist => value.is_none(),
        }
    }
}

/// A label selector after `LabelSelectorAsSelector`: an unset selector selects nothing,
/// an empty one (no labels, no expressions) everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LabelSelector {
    /// An unset selector.
    #[default]
    Nothing,
    /// Every requirement must hold; none: everything.
    Requirements(Vec<LabelRequirement>),
}

impl LabelSelector {
    /// The selector that selects everything (`{}`).
    pub fn everything() -> Self {
        LabelSelector::Requirements(Vec::new())
    }

    /// `matchLabels` only.
    pub fn of_labels(pairs: &[(&str, &str)]) -> Self {
        LabelSelector::Requirements(
            pairs
                .iter()
                .map(|(k, v)| LabelRequirement::new(k, LabelOperator::In, &[v]))
                .collect(),
        )
    }

    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            LabelSelector::Nothing => false,
            LabelSelector::Requirements(requirements) => requirements.iter().all(|r| r.matches(labels)),
        }
    }

    /// A selector with no requirements (`labels.Selector.Empty()`): it selects everything.
    pub fn is_empty(&self) -> bool {
        matches!(self, LabelSelector::Requirements(r) if r.is_empty())
    }

    /// Adds `key In (value)` for each pair (`matchLabelKeys`), `key NotIn (value)` with
    /// `negated` (`mismatchLabelKeys`). An unset selector stays unset.
    pub fn with_pairs(mut self, pairs: &[(String, String)], negated: bool) -> Self {
        if let LabelSelector::Requirements(requirements) = &mut self {
            let operator = if negated {
                LabelOperator::NotIn
            } else {
                LabelOperator::In
            };
            for (key, value) in pairs {
                requirements.push(LabelRequirement {
                    key: key.clone(),
                    operator,
                    values: vec![value.clone()],
                });
            }
        }
        self
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LabelSelector::Nothing => f.write_str("<none>"),
            LabelSelector::Requirements(requirements) if requirements.is_empty() => f.write_str("<all>"),
            LabelSelector::Requirements(requirements) => {
                let parts: Vec<String> = requirements
                    .iter()
                    .map(|r| match r.operator {
                        LabelOperator::In if r.values.len() == 1 => format!("{}={}", r.key, r.values[0]),
                        LabelOperator::In => format!("{} in ({})", r.key, r.values.join(",")),
                        LabelOperator::NotIn if r.values.len() == 1 => format!("{}!={}", r.key, r.values[0]),
                        LabelOperator::NotIn => format!("{} notin ({})", r.key, r.values.join(",")),
                        LabelOperator::Exists => r.key.clone(),
                        LabelOperator::DoesNotExist => format!("!{}", r.key),
                    })
                    .collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn unset_selects_nothing_and_empty_everything() {
        let l = labels(&[("app", "worker")]);
        assert!(!LabelSelector::Nothing.matches(&l));
        assert!(LabelSelector::everything().matches(&l));
        assert!(LabelSelector::everything().matches(&BTreeMap::new()));
        assert!(LabelSelector::everything().is_empty() && !LabelSelector::Nothing.is_empty());
    }

    #[test]
    fn operators_as_kubernetes_evaluates_them() {
        let l = labels(&[("app", "worker"), ("tier", "gpu")]);
        let sel = |r: Vec<LabelRequirement>| LabelSelector::Requirements(r);
        assert!(sel(vec![LabelRequirement::new("app", LabelOperator::In, &["worker", "x"])]).matches(&l));
        assert!(!sel(vec![LabelRequirement::new("app", LabelOperator::NotIn, &["worker"])]).matches(&l));
        assert!(
            sel(vec![LabelRequirement::new("zone", LabelOperator::NotIn, &["a"])]).matches(&l),
            "an absent key is not in any set"
        );
        assert!(sel(vec![LabelRequirement::new("tier", LabelOperator::Exists, &[])]).matches(&l));
        assert!(!sel(vec![LabelRequirement::new("tier", LabelOperator::DoesNotExist, &[])]).matches(&l));
        let merged = LabelSelector::of_labels(&[("app", "worker")]).with_pairs(&[("tier".into(), "cpu".into())], false);
        assert!(!merged.matches(&l));
        assert_eq!(merged.to_string(), "app=worker,tier=cpu");
        assert_eq!(
            LabelSelector::Nothing.with_pairs(&[("a".into(), "b".into())], false),
            LabelSelector::Nothing
        );
    }
}
