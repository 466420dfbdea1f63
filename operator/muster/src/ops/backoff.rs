//! Exponential backoff for retries: 1 s after the first failure, doubling after each
//! further one, never more than a cap.

use std::time::Duration;

/// The wait after `failures` consecutive failures (at least one), at most `cap`.
pub fn exponential(failures: u32, cap: Duration) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    Duration::from_secs(1u64 << doublings).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_one_second_up_to_the_cap() {
        let cap = Duration::from_secs(60);
        let waits: Vec<u64> = (1..=9).map(|f| exponential(f, cap).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(exponential(0, cap), Duration::from_secs(1));
        assert_eq!(
            exponential(u32::MAX, Duration::from_secs(300)),
            Duration::from_secs(300)
        );
    }
}
