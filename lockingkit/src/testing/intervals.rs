//! The interval checker: records every hold and proves no two overlapped.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use tokio::time::Instant;

/// One hold of a lock, from the moment `acquire` returned to the moment `release` was called.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldInterval {
    /// The key held.
    pub key: String,
    /// Which "process" held it.
    pub process: usize,
    /// The fencing token of the hold.
    pub fencing_token: u64,
    /// When acquiring returned.
    pub start: Instant,
    /// When releasing began (or loss was seen).
    pub end: Instant,
}

/// Collects holds from many tasks and checks mutual exclusion and fencing order.
#[derive(Debug, Default)]
pub struct IntervalChecker {
    holds: Mutex<Vec<HeldInterval>>,
}

impl IntervalChecker {
    /// An empty checker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one hold.
    pub fn record(&self, hold: HeldInterval) {
        self.holds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(hold);
    }

    /// Every hold recorded so far.
    pub fn holds(&self) -> Vec<HeldInterval> {
        self.holds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Describes every violation: two holds of one key that overlap, or fencing tokens that do
    /// not increase in the order the holds began. Empty when the holds are consistent.
    pub fn violations(&self) -> Vec<String> {
        let mut by_key: HashMap<String, Vec<HeldInterval>> = HashMap::new();
        for hold in self.holds() {
            by_key.entry(hold.key.clone()).or_default().push(hold);
        }
        let mut violations = Vec::new();
        for holds in by_key.values_mut() {
            holds.sort_by_key(|h| h.start);
            for pair in holds.windows(2) {
                let (a, b) = (&pair[0], &pair[1]);
                if b.start < a.end {
                    violations.push(format!(
                        "overlap: process {} (token {}) began {:?} before process {} (token {}) ended",
                        b.process,
                        b.fencing_token,
                        a.end - b.start,
                        a.process,
                        a.fencing_token
                    ));
                }
                if b.fencing_token <= a.fencing_token {
                    violations.push(format!(
                        "fencing token {} of process {} does not exceed the earlier {} of process {}",
                        b.fencing_token, b.process, a.fencing_token, a.process
                    ));
                }
            }
        }
        violations
    }

    /// For a semaphore: describes every instant at which more than `max_holders` holds of one
    /// key overlapped. Fencing tokens are not compared, since a backend may keep them per slot.
    pub fn count_violations(&self, max_holders: usize) -> Vec<String> {
        let mut by_key: HashMap<String, Vec<HeldInterval>> = HashMap::new();
        for hold in self.holds() {
            by_key.entry(hold.key.clone()).or_default().push(hold);
        }
        let mut violations = Vec::new();
        for holds in by_key.values() {
            // Ends sort before starts at the same instant: a hold that ends as another begins
            // does not overlap it.
            let mut events: Vec<(Instant, bool, &HeldInterval)> = holds
                .iter()
                .flat_map(|h| [(h.start, true, h), (h.end, false, h)])
                .collect();
            events.sort_by_key(|(at, starts, _)| (*at, *starts));
            let mut current = 0usize;
            for (_, starts, hold) in events {
                if !starts {
                    current = current.saturating_sub(1);
                    continue;
                }
                current += 1;
                if current > max_holders {
                    violations.push(format!(
                        "{current} holders at once (at most {max_holders}): process {} (token {}) \
                         began while {} others held",
                        hold.process,
                        hold.fencing_token,
                        current - 1
                    ));
                }
            }
        }
        violations
    }

    /// Panics if more than `max_holders` holds of one key ever overlapped.
    pub fn assert_at_most(&self, max_holders: usize) {
        let violations = self.count_violations(max_holders);
        assert!(
            violations.is_empty(),
            "{} violations:\n{}",
            violations.len(),
            violations.join("\n")
        );
    }

    /// Panics with every violation, if there is any.
    pub fn assert_consistent(&self) {
        let violations = self.violations();
        assert!(
            violations.is_empty(),
            "{} violations:\n{}",
            violations.len(),
            violations.join("\n")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn hold(process: usize, token: u64, start_ms: u64, end_ms: u64, base: Instant) -> HeldInterval {
        HeldInterval {
            key: "k".into(),
            process,
            fencing_token: token,
            start: base + Duration::from_millis(start_ms),
            end: base + Duration::from_millis(end_ms),
        }
    }

    #[test]
    fn counts_holders_at_once() {
        let base = Instant::now();
        let checker = IntervalChecker::new();
        checker.record(hold(0, 1, 0, 10, base));
        checker.record(hold(1, 2, 5, 20, base));
        checker.record(hold(2, 3, 10, 30, base)); // starts as the first ends: two at once
        assert!(checker.count_violations(2).is_empty());
        checker.record(hold(3, 4, 15, 16, base)); // three at once
        assert_eq!(checker.count_violations(2).len(), 1);
        assert!(checker.count_violations(3).is_empty());
    }

    #[test]
    fn finds_overlaps_and_tokens_out_of_order() {
        let base = Instant::now();
        let checker = IntervalChecker::new();
        checker.record(hold(0, 1, 0, 10, base));
        checker.record(hold(1, 2, 10, 20, base));
        assert!(checker.violations().is_empty());
        checker.record(hold(2, 3, 15, 30, base));
        checker.record(hold(3, 2, 40, 50, base));
        let violations = checker.violations();
        assert_eq!(violations.len(), 2, "{violations:?}");
        assert!(violations[0].starts_with("overlap"));
        assert!(violations[1].starts_with("fencing"));
    }
}
