//! Node-level resources (CPU, memory, ephemeral storage, pods, extended resources), as
//! the scheduler's NodeResourcesFit filter counts them.

use std::collections::BTreeMap;
use std::fmt;

/// Amounts of node resources. CPU in milli-cores, everything else in whole units
/// (bytes for memory and storage).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_millis: i64,
    pub memory: i64,
    pub ephemeral_storage: i64,
    pub pods: i64,
    /// Extended resources and hugepages, by resource name.
    pub other: BTreeMap<String, i64>,
}

impl Resources {
    pub fn add(&mut self, other: &Resources) {
        self.cpu_millis += other.cpu_millis;
        self.memory += other.memory;
        self.ephemeral_storage += other.ephemeral_storage;
        self.pods += other.pods;
        for (name, value) in &other.other {
            *self.other.entry(name.clone()).or_default() += value;
        }
    }

    pub fn sub(&mut self, other: &Resources) {
        self.cpu_millis -= other.cpu_millis;
        self.memory -= other.memory;
        self.ephemeral_storage -= other.ephemeral_storage;
        self.pods -= other.pods;
        for (name, value) in &other.other {
            *self.other.entry(name.clone()).or_default() -= value;
        }
    }

    /// The first resource of `request` that does not fit into `self` (taken as free
    /// capacity), with what is asked and what is free.
    pub fn shortfall(&self, request: &Resources) -> Option<Shortfall> {
        let check = |name: &str, want: i64, free: i64| {
            (want > 0 && want > free).then(|| Shortfall {
                resource: name.to_string(),
                requested: want,
                free,
            })
        };
        check("pods", request.pods, self.pods)
            .or_else(|| check("cpu", request.cpu_millis, self.cpu_millis))
            .or_else(|| check("memory", request.memory, self.memory))
            .or_else(|| check("ephemeral-storage", request.ephemeral_storage, self.ephemeral_storage))
            .or_else(|| {
                request
                    .other
                    .iter()
                    .find_map(|(name, want)| check(name, *want, self.other.get(name).copied().unwrap_or(0)))
            })
    }

    pub fn fits_in(&self, free: &Resources) -> bool {
        free.shortfall(self).is_none()
    }

    /// How many copies of `request` fit into `self` (free capacity), at most `limit`.
    pub fn copies_of(&self, request: &Resources, limit: usize) -> usize {
        let mut copies = limit as i64;
        let mut bound = |want: i64, free: i64| {
            if want > 0 {
                copies = copies.min((free / want).max(0));
            }
        };
        bound(request.pods, self.pods);
        bound(request.cpu_millis, self.cpu_millis);
        bound(request.memory, self.memory);
        bound(request.ephemeral_storage, self.ephemeral_storage);
        for (name, want) in &request.other {
            bound(*want, self.other.get(name).copied().unwrap_or(0));
        }
        copies.max(0) as usize
    }
}

/// A resource a pod asks for more of than a node has free.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    pub resource: String,
    pub requested: i64,
    pub free: i64,
}

impl fmt::Display for Shortfall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.resource.as_str() {
            "cpu" => write!(f, "cpu: needs {}m, {}m free", self.requested, self.free),
            "memory" | "ephemeral-storage" => {
                write!(
                    f,
                    "{}: needs {}, {} free",
                    self.resource,
                    bytes(self.requested),
                    bytes(self.free)
                )
            }
            _ => write!(f, "{}: needs {}, {} free", self.resource, self.requested, self.free),
        }
    }
}

fn bytes(value: i64) -> String {
    const GI: i64 = 1 << 30;
    const MI: i64 = 1 << 20;
    if value.abs() >= GI && value % GI == 0 {
        format!("{}Gi", value / GI)
    } else if value.abs() >= MI && value % MI == 0 {
        format!("{}Mi", value / MI)
    } else {
        value.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(cpu: i64, memory_gi: i64, gpus: i64) -> Resources {
        let mut res = Resources {
            cpu_millis: cpu,
            memory: memory_gi << 30,
            pods: 1,
            ..Default::default()
        };
        if gpus > 0 {
            res.other.insert("example.com/gpu".into(), gpus);
        }
        res
    }

    #[test]
    fn shortfall_names_the_resource_with_numbers() {
        let mut free = r(4000, 16, 0);
        free.pods = 110;
        assert_eq!(free.shortfall(&r(2000, 8, 0)), None);
        let short = free.shortfall(&r(8000, 8, 0)).unwrap();
        assert_eq!(short.to_string(), "cpu: needs 8000m, 4000m free");
        let short = free.shortfall(&r(1000, 32, 0)).unwrap();
        assert_eq!(short.to_string(), "memory: needs 32Gi, 16Gi free");
        let short = free.shortfall(&r(1000, 1, 2)).unwrap();
        assert_eq!(short.to_string(), "example.com/gpu: needs 2, 0 free");
    }

    #[test]
    fn copies_and_arithmetic() {
        let mut free = r(64000, 512, 0);
        free.pods = 110;
        assert_eq!(free.copies_of(&r(16000, 128, 0), 100), 4);
        assert_eq!(free.copies_of(&r(0, 0, 0), 7), 7);
        free.sub(&r(16000, 128, 0));
        assert_eq!(free.cpu_millis, 48000);
        free.add(&r(16000, 128, 0));
        assert_eq!(free.memory, 512 << 30);
    }
}
