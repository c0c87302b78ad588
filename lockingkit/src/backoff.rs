//! Capped exponential backoff with equal jitter.
//!
//! The cap is what makes waiting fair across processes: a caller that has waited a minute polls
//! as often as one that just arrived. Equal jitter keeps half of each delay fixed, so a waiter
//! never hammers the backend, and randomises the other half, so waiters in different processes
//! drift apart instead of polling in lock step.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// The sleep before a retry: half of `delay`, plus `unit` (in `[0, 1)`) times the other half.
pub(crate) fn equal_jitter(delay: Duration, unit: f64) -> Duration {
    let half = delay / 2;
    half + half.mul_f64(unit.clamp(0.0, 1.0))
}

/// The delay schedule of one waiter: `min`, doubling to `max`, each jittered.
#[derive(Debug)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
    /// Whether a delay at the cap is taken whole rather than jittered (see
    /// [`exact_at_cap`](Backoff::exact_at_cap)).
    exact_cap: bool,
    rng: SplitMix64,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Backoff {
            min,
            max,
            next: min,
            exact_cap: false,
            rng: SplitMix64::seeded(),
        }
    }

    /// The same schedule, except that once the delay reaches the cap it is taken whole: the
    /// schedule of an outage's probes, where the cap is both the most a sick server is asked
    /// (at most once per cap) and the longest a server that is back goes unasked. The jittered
    /// delays below the cap still spread instances apart.
    pub(crate) fn exact_at_cap(mut self) -> Self {
        self.exact_cap = true;
        self
    }

    /// The next sleep; the underlying delay doubles until it reaches the cap.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = delay.saturating_mul(2).min(self.max).max(self.min);
        if self.exact_cap && delay >= self.max {
            return delay;
        }
        equal_jitter(delay, self.rng.next_unit())
    }

    /// Starts the schedule over, after a success.
    pub(crate) fn reset(&mut self) {
        self.next = self.min;
    }
}

/// A tiny, well-distributed PRNG; jitter needs spread, not secrecy.
#[derive(Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn seeded() -> Self {
        // RandomState is seeded per process from the OS, and each instance differs.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(0x5eed);
        SplitMix64(hasher.finish())
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `[0, 1)`.
    fn next_unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn default_schedule_doubles_from_50ms_to_1s_and_stays_there() {
        let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
        let bases = [50u64, 100, 200, 400, 800, 1000, 1000, 1000];
        for base in bases {
            let base = Duration::from_millis(base);
            let sleep = backoff.next_delay();
            assert!(sleep >= base / 2, "{sleep:?} below half of {base:?}");
            assert!(sleep <= base, "{sleep:?} above {base:?}");
        }
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(50));
    }

    /// The generator is SplitMix64 exactly: its published first outputs from seed 0.
    #[test]
    fn the_generator_is_splitmix64() {
        let mut rng = SplitMix64(0);
        let outputs = [
            rng.next_u64(),
            rng.next_u64(),
            rng.next_u64(),
            rng.next_u64(),
        ];
        assert_eq!(
            outputs,
            [
                0xE220_A839_7B1D_CDAF,
                0x6E78_9E6A_A1B9_65F4,
                0x06C4_5D18_8009_454F,
                0xF88B_B8A8_724C_81EC
            ]
        );
    }

    #[test]
    fn jitter_spreads_over_the_upper_half() {
        let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(1));
        let sleeps: Vec<_> = (0..200).map(|_| backoff.next_delay()).collect();
        let low = sleeps
            .iter()
            .filter(|d| **d < Duration::from_millis(750))
            .count();
        // With a uniform jitter about half fall in each quarter; 200 draws make 40..160 certain
        // for any sane generator.
        assert!(
            (40..160).contains(&low),
            "{low} of 200 in the lower quarter"
        );
    }

    proptest! {
        #[test]
        fn every_sleep_stays_within_half_the_cap_and_the_cap(
            min_ms in 1u64..2_000,
            extra_ms in 0u64..10_000,
            steps in 1usize..40,
        ) {
            let min = Duration::from_millis(min_ms);
            let max = min + Duration::from_millis(extra_ms);
            let mut backoff = Backoff::new(min, max);
            for _ in 0..steps {
                let sleep = backoff.next_delay();
                prop_assert!(sleep >= min / 2);
                prop_assert!(sleep <= max);
            }
        }

        #[test]
        fn equal_jitter_is_between_half_and_whole(ms in 0u64..100_000, unit in 0.0f64..1.0) {
            let delay = Duration::from_millis(ms);
            let sleep = equal_jitter(delay, unit);
            prop_assert!(sleep >= delay / 2 && sleep <= delay);
        }
    }
}
