//! Exponential backoff with jitter for retries: the wait after the n-th consecutive
//! failure lies between half of and all of `min(2^(n-1) s, cap)`, so gangs or Workloads
//! that failed together do not all retry in the same instant.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};

/// The wait after `failures` consecutive failures (at least one), at most `cap`.
pub fn exponential(failures: u32, cap: Duration) -> Duration {
    // Past this many doublings every wait is the cap's.
    let steps = failures.clamp(1, 40) as usize;
    // Jitter adds up to the whole delay, so the sequence starts at half of a second and
    // stops at half of the cap: jittered, from 0.5–1 s up to cap/2–cap.
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(500))
        .with_factor(2.0)
        .with_max_delay(cap / 2)
        .with_jitter()
        .without_max_times()
        .build()
        .nth(steps - 1)
        .unwrap_or(cap)
        .min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_one_second_up_to_the_cap_with_jitter_below_each_step() {
        let cap = Duration::from_secs(60);
        let full = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0];
        for _ in 0..50 {
            for (failures, full) in (1..).zip(full) {
                let wait = exponential(failures, cap).as_secs_f64();
                assert!(
                    wait >= full / 2.0 - 1e-9 && wait <= full + 1e-9,
                    "after {failures} failures: {wait} s, expected between {} and {full}",
                    full / 2.0
                );
            }
        }
        assert!(exponential(0, cap) <= Duration::from_secs(1));
        assert!(exponential(u32::MAX, Duration::from_secs(300)) <= Duration::from_secs(300));
        assert!(exponential(u32::MAX, Duration::from_secs(300)) >= Duration::from_secs(150));
    }

    #[test]
    fn waits_of_one_step_differ() {
        let waits: std::collections::BTreeSet<u128> = (0..20)
            .map(|_| exponential(5, Duration::from_secs(60)).as_micros())
            .collect();
        assert!(waits.len() > 1, "no jitter: {waits:?}");
    }
}
