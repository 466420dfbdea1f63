//! The names of a job's Workload and of its pod groups. A job's name and a replicated
//! job's name follow looser rules (a Job may be named `train.v2`, a replicated job up to
//! 63 characters) than a Workload's (a DNS-1035 label that, with each group, leaves room
//! for pod names of 63 characters), so a name that does not fit is made to: characters
//! outside `[a-z0-9-]` become `-`, and a hash of the whole original name keeps distinct
//! names distinct. The webhook (labels on the pods) and the adoption controller (the
//! Workload) name things with the same functions.

use muster_api::v1alpha1::MAX_WORKLOAD_AND_GROUP_NAME;

use crate::frameworks::Framework;

/// The longest group name kept as it is: longer ones are cut, so that a Workload name
/// always has room beside it.
pub const MAX_GROUP_NAME: usize = 40;
/// Characters of the hash that ends a cut name: 40 bits in base 32.
const HASH_CHARS: usize = 8;

/// FNV-1a: stable across releases, unlike the standard library's hasher.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// 40 bits of `text`'s hash in lowercase base 32 (`a-z`, `2-7`).
fn hash(text: &str) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut bits = fnv1a(text);
    (0..HASH_CHARS)
        .map(|_| {
            let c = ALPHABET[(bits & 31) as usize] as char;
            bits >>= 5;
            c
        })
        .collect()
}

/// `text` in lowercase with every character outside `[a-z0-9-]` made `-`.
fn sanitized(text: &str) -> String {
    text.chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// `text` if it is a DNS-1035 label of at most `room` characters, else its sanitized
/// form cut to fit with `-<hash>` of `text` at the end.
fn fitted(text: &str, room: usize) -> String {
    let clean = sanitized(text);
    let starts_with_letter = clean.starts_with(|c: char| c.is_ascii_lowercase());
    if clean == text && starts_with_letter && !clean.ends_with('-') && clean.len() <= room {
        return clean;
    }
    let keep = room.saturating_sub(HASH_CHARS + 1);
    let cut = clean[..clean.len().min(keep)].trim_matches('-');
    if cut.is_empty() || !cut.starts_with(|c: char| c.is_ascii_lowercase()) {
        // Nothing readable to keep: a letter first, as a DNS-1035 label needs.
        return format!("x-{}", hash(text));
    }
    format!("{cut}-{}", hash(text))
}

/// The pod group a replicated job (or a Job's only template) stands for.
pub fn group_name(replicated_job: &str) -> String {
    fitted(replicated_job, MAX_GROUP_NAME)
}

/// The Workload of job `name` of `framework`: `<prefix>-<name>`, made to fit beside its
/// longest group name.
pub fn workload_name(framework: Framework, name: &str, longest_group: usize) -> String {
    let room = MAX_WORKLOAD_AND_GROUP_NAME.saturating_sub(longest_group.min(MAX_GROUP_NAME));
    fitted(&format!("{}-{name}", framework.prefix()), room)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_dns_1035(name: &str) -> bool {
        name.starts_with(|c: char| c.is_ascii_lowercase())
            && !name.ends_with('-')
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    }

    #[test]
    fn names_that_fit_stay_and_others_are_made_to_fit_with_a_hash() {
        assert_eq!(workload_name(Framework::Job, "sweep", 4), "job-sweep");
        assert_eq!(group_name("workers"), "workers");
        let dotted = workload_name(Framework::Job, "train.v2", 4);
        assert!(is_dns_1035(&dotted) && dotted.starts_with("job-train-v2-"), "{dotted}");
        assert_ne!(
            dotted,
            workload_name(Framework::Job, "train-v2", 4),
            "not the dashed name"
        );
        let long = "a".repeat(63);
        let cut = workload_name(Framework::JobSet, &long, 8);
        assert!(
            cut.len() + 8 <= MAX_WORKLOAD_AND_GROUP_NAME && is_dns_1035(&cut),
            "{cut}"
        );
        assert_ne!(cut, workload_name(Framework::JobSet, &format!("{long}b"), 8));
        let group = group_name(&"w".repeat(63));
        assert!(group.len() <= MAX_GROUP_NAME && is_dns_1035(&group), "{group}");
        // The longest group leaves room for a Workload name.
        let beside = workload_name(Framework::JobSet, &long, group.len());
        assert!(beside.len() + group.len() <= MAX_WORKLOAD_AND_GROUP_NAME, "{beside}");
        assert!(is_dns_1035(&group_name("0-starts-with-a-digit")));
        assert!(is_dns_1035(&group_name("UPPER")));
    }

    #[test]
    fn the_hash_has_forty_bits() {
        assert_eq!(hash("x").len(), 8);
        let distinct: std::collections::BTreeSet<String> = (0..10_000).map(|i| hash(&i.to_string())).collect();
        assert_eq!(distinct.len(), 10_000);
    }
}
