//! Identities of namespaced objects: a pod or a claim is named by its namespace and name,
//! typed so that one kind's key cannot stand in for another's.
//!
//! A key keeps `namespace/name` as one string and where the two meet: the engine holds
//! a key for every pod of the cluster, and one allocation per key is half of two. It
//! orders as that string does, which is how these keys ordered when they were strings.

use std::fmt;

/// `namespace/name` of a namespaced object.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    joined: Box<str>,
    /// Byte offset of the `/` between namespace and name.
    slash: u32,
}

impl ObjectKey {
    pub fn new(namespace: &str, name: &str) -> Self {
        ObjectKey {
            joined: format!("{namespace}/{name}").into_boxed_str(),
            slash: u32::try_from(namespace.len()).expect("a namespace is at most 63 bytes"),
        }
    }

    pub fn namespace(&self) -> &str {
        &self.joined[..self.slash as usize]
    }

    pub fn name(&self) -> &str {
        &self.joined[self.slash as usize + 1..]
    }

    /// `namespace/name`, as Kubernetes writes it in messages.
    pub fn as_str(&self) -> &str {
        &self.joined
    }
}

/// An empty name in no namespace.
impl Default for ObjectKey {
    fn default() -> Self {
        ObjectKey::new("", "")
    }
}

/// Splits `namespace/name` at the first `/`, as Kubernetes does with its own keys (a
/// namespace never holds one); a string without `/` is a name without a namespace.
impl From<&str> for ObjectKey {
    fn from(joined: &str) -> Self {
        match joined.split_once('/') {
            Some((namespace, name)) => ObjectKey::new(namespace, name),
            None => ObjectKey::new("", joined),
        }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.joined)
    }
}

impl fmt::Debug for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.joined, f)
    }
}

macro_rules! typed_key {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(ObjectKey);

        impl $name {
            pub fn new(namespace: &str, name: &str) -> Self {
                $name(ObjectKey::new(namespace, name))
            }

            pub fn namespace(&self) -> &str {
                self.0.namespace()
            }

            pub fn name(&self) -> &str {
                self.0.name()
            }

            /// `namespace/name`.
            pub fn as_str(&self) -> &str {
                self.0.as_str()
            }

            pub fn object(&self) -> &ObjectKey {
                &self.0
            }
        }

        impl From<ObjectKey> for $name {
            fn from(key: ObjectKey) -> Self {
                $name(key)
            }
        }

        /// See [`ObjectKey`]'s `From<&str>`.
        impl From<&str> for $name {
            fn from(joined: &str) -> Self {
                $name(ObjectKey::from(joined))
            }
        }

        impl From<String> for $name {
            fn from(joined: String) -> Self {
                $name(ObjectKey::from(joined.as_str()))
            }
        }

        /// Compares with the `namespace/name` form.
        impl PartialEq<str> for $name {
            fn eq(&self, joined: &str) -> bool {
                self.as_str() == joined
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, joined: &&str) -> bool {
                self.as_str() == *joined
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }
    };
}

typed_key!(
    /// A pod's identity.
    PodKey
);
typed_key!(
    /// A ResourceClaim's identity.
    ClaimKey
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gives_back_its_parts_and_prints_as_kubernetes_does() {
        let key = ClaimKey::new("team-a", "llama-workers-0-gpu");
        assert_eq!(key.namespace(), "team-a");
        assert_eq!(key.name(), "llama-workers-0-gpu");
        assert_eq!(key.to_string(), "team-a/llama-workers-0-gpu");
        assert_eq!(format!("{key:?}"), "\"team-a/llama-workers-0-gpu\"");
        let empty = PodKey::new("", "p");
        assert_eq!((empty.namespace(), empty.name()), ("", "p"));
        assert_eq!(ClaimKey::from("team-a/llama-workers-0-gpu"), key);
        assert_eq!(PodKey::from("p"), empty);
    }

    #[test]
    fn keys_order_as_their_joined_strings() {
        let mut keys = [PodKey::new("a", "x"), PodKey::new("a-b", "x"), PodKey::new("a", "w")];
        keys.sort();
        let joined: Vec<&str> = keys.iter().map(PodKey::as_str).collect();
        let mut strings = joined.clone();
        strings.sort();
        assert_eq!(joined, strings);
    }
}
