//! A map from names to values held as one sorted vector. A device has a handful of
//! attributes and capacities and a cluster has tens of thousands of devices; a B-tree
//! gives each map a node sized for eleven entries, a vector just what it holds.

use std::borrow::Borrow;

/// Entries sorted by name, each name once. Lookups are binary searches.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NameMap<V> {
    entries: Vec<(String, V)>,
}

impl<V> Default for NameMap<V> {
    fn default() -> Self {
        NameMap { entries: Vec::new() }
    }
}

impl<V> NameMap<V> {
    pub fn new() -> Self {
        Self::default()
    }

    fn position<Q>(&self, name: &Q) -> Result<usize, usize>
    where
        String: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.entries.binary_search_by(|(key, _)| key.borrow().cmp(name))
    }

    pub fn get<Q>(&self, name: &Q) -> Option<&V>
    where
        String: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.position(name).ok().map(|at| &self.entries[at].1)
    }

    pub fn contains_key<Q>(&self, name: &Q) -> bool
    where
        String: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.position(name).is_ok()
    }

    /// Sets `name` to `value`, returning the value it replaces.
    pub fn insert(&mut self, name: String, value: V) -> Option<V> {
        match self.position(name.as_str()) {
            Ok(at) => Some(std::mem::replace(&mut self.entries[at].1, value)),
            Err(at) => {
                self.entries.insert(at, (name, value));
                None
            }
        }
    }

    pub fn remove<Q>(&mut self, name: &Q) -> Option<V>
    where
        String: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.position(name).ok().map(|at| self.entries.remove(at).1)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries in name order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&String, &V)> + DoubleEndedIterator {
        self.entries.iter().map(|(key, value)| (key, value))
    }

    pub fn keys(&self) -> impl ExactSizeIterator<Item = &String> + DoubleEndedIterator {
        self.entries.iter().map(|(key, _)| key)
    }

    pub fn values(&self) -> impl ExactSizeIterator<Item = &V> + DoubleEndedIterator {
        self.entries.iter().map(|(_, value)| value)
    }
}

impl<V> FromIterator<(String, V)> for NameMap<V> {
    /// Later entries win over earlier ones of the same name, as in a `BTreeMap`.
    fn from_iter<I: IntoIterator<Item = (String, V)>>(entries: I) -> Self {
        let mut entries: Vec<(String, V)> = entries.into_iter().collect();
        // Stable: among equal names the last one read stays last, and is kept.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let mut kept: Vec<(String, V)> = Vec::with_capacity(entries.len());
        for entry in entries {
            match kept.last_mut() {
                Some(last) if last.0 == entry.0 => *last = entry,
                _ => kept.push(entry),
            }
        }
        kept.shrink_to_fit();
        NameMap { entries: kept }
    }
}

impl<V, const N: usize> From<[(String, V); N]> for NameMap<V> {
    fn from(entries: [(String, V); N]) -> Self {
        entries.into_iter().collect()
    }
}

impl<'a, V> IntoIterator for &'a NameMap<V> {
    type Item = (&'a String, &'a V);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (String, V)>, fn(&'a (String, V)) -> (&'a String, &'a V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.iter().map(|(key, value)| (key, value))
    }
}

impl<V> IntoIterator for NameMap<V> {
    type Item = (String, V);
    type IntoIter = std::vec::IntoIter<(String, V)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.into_iter()
    }
}

impl<V> std::ops::Index<&str> for NameMap<V> {
    type Output = V;

    fn index(&self, name: &str) -> &V {
        self.get(name).unwrap_or_else(|| panic!("no entry named {name:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_names_sorted_and_unique_with_the_last_value_read() {
        let map: NameMap<i32> = [("b", 1), ("a", 2), ("b", 3), ("c", 4)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(map.keys().map(String::as_str).collect::<Vec<_>>(), ["a", "b", "c"]);
        assert_eq!(map.get("b"), Some(&3));
        assert_eq!(map["c"], 4);
        assert!(!map.contains_key("d"));
    }

    #[test]
    fn inserts_and_removes_in_place() {
        let mut map = NameMap::new();
        assert_eq!(map.insert("m".to_string(), 1), None);
        assert_eq!(map.insert("a".to_string(), 2), None);
        assert_eq!(map.insert("m".to_string(), 3), Some(1));
        assert_eq!(
            map.iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>(),
            [("a", 2), ("m", 3)]
        );
        assert_eq!(map.remove("a"), Some(2));
        assert_eq!(map.len(), 1);
    }
}
