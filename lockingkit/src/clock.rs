//! Instants a caller's durations point to, without overflow.
//!
//! Every duration LockingKit takes — a caller's timeout, a lease from a configuration file, a
//! backend's check interval — may be `Duration::MAX`, which means "as long as it takes". Adding
//! such a duration to an instant overflows, and `Instant + Duration` panics when it does; so
//! every instant computed from an outside duration goes through [`after`].

use std::time::Duration;

use tokio::time::Instant;

/// Far enough that nothing LockingKit waits for outlives it, near enough to add to any instant
/// a process can observe.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `start + duration`, or about a century after `start` when that cannot be represented: a
/// deadline that never comes in the life of the process.
pub(crate) fn after(start: Instant, duration: Duration) -> Instant {
    start
        .checked_add(duration)
        .or_else(|| start.checked_add(FAR_FUTURE))
        .unwrap_or(start)
}

/// The instant `duration` from now (see [`after`]).
pub(crate) fn in_(duration: Duration) -> Instant {
    after(Instant::now(), duration)
}

/// 90% of `duration`, exactly and without overflow.
pub(crate) fn nine_tenths(duration: Duration) -> Duration {
    duration - duration / 10
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_longest_duration_is_a_deadline_that_never_comes() {
        let now = Instant::now();
        assert!(after(now, Duration::MAX) > after(now, Duration::from_secs(365 * 24 * 3600)));
        assert_eq!(
            after(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
    }

    proptest! {
        #[test]
        fn after_never_panics_and_never_goes_back(secs in any::<u64>(), nanos in 0u32..1_000_000_000) {
            let now = Instant::now();
            let duration = Duration::new(secs, nanos);
            let deadline = after(now, duration);
            prop_assert!(deadline >= now);
            if let Some(exact) = now.checked_add(duration) {
                prop_assert_eq!(deadline, exact);
            }
        }

        #[test]
        fn nine_tenths_is_exact_where_it_can_be_and_never_panics(secs in any::<u64>(), nanos in 0u32..1_000_000_000) {
            let duration = Duration::new(secs, nanos);
            let part = nine_tenths(duration);
            prop_assert!(part <= duration);
            if let Some(times_nine) = duration.checked_mul(9) {
                let exact = times_nine / 10;
                // Integer division rounds each form differently by at most a nanosecond.
                prop_assert!(part.abs_diff(exact) <= Duration::from_nanos(1));
            }
        }
    }
}
