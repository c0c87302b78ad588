//! Waiting inside a caller's transaction: try, back off, try again, until the deadline.
//!
//! A wait never sits in one long statement: a blocking `pg_advisory_xact_lock` would keep the
//! transaction's snapshot for as long as it waits, and bounding it with `lock_timeout` writes
//! an ERROR line to the server log each time a slice ends (and aborts the transaction unless a
//! savepoint catches it). So a wait is a series of try-locks, each one short statement, with the
//! engine's schedule between them (`crate::backoff`): capped exponential delays with equal jitter.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::clock;
use crate::error::LockError;

/// Runs `attempt` until it takes the lock, the wait of `timeout` ends, or an attempt fails.
///
/// Busy answers are followed by a sleep from `delays`, never past the deadline; no attempt
/// starts once the deadline has come, and a wait that ends busy is
/// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout). The first failure ends the wait: in a
/// transaction, a failed statement aborts the transaction, so no later attempt could succeed.
pub(super) async fn until_taken<T, F, A>(
    timeout: Duration,
    mut delays: Backoff,
    mut attempt: F,
) -> Result<T, LockError>
where
    F: FnMut() -> A,
    A: Future<Output = Result<Option<T>, LockError>>,
{
    let deadline = clock::in_(timeout);
    loop {
        if let Some(taken) = attempt().await? {
            return Ok(taken);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(LockError::timed_out(timeout));
        }
        tokio::time::sleep_until(clock::after(now, delays.next_delay()).min(deadline)).await;
        if Instant::now() >= deadline {
            return Err(LockError::timed_out(timeout));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::error::ErrorKind;

    /// Records when each attempt started and answers from `answers` (busy once they run out).
    struct Script {
        started: Instant,
        at: RefCell<Vec<Duration>>,
        answers: RefCell<Vec<Result<Option<u64>, LockError>>>,
    }

    impl Script {
        fn new(mut answers: Vec<Result<Option<u64>, LockError>>) -> Self {
            answers.reverse();
            Script {
                started: Instant::now(),
                at: RefCell::new(Vec::new()),
                answers: RefCell::new(answers),
            }
        }

        async fn attempt(&self) -> Result<Option<u64>, LockError> {
            self.at.borrow_mut().push(self.started.elapsed());
            self.answers.borrow_mut().pop().unwrap_or(Ok(None))
        }
    }

    fn delays() -> Backoff {
        Backoff::new(Duration::from_millis(50), Duration::from_secs(1))
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_stays_busy_ends_in_timeout_at_its_deadline_with_no_attempt_after_it() {
        let script = Script::new(Vec::new());
        let timeout = Duration::from_millis(3500);
        let result = until_taken(timeout, delays(), || script.attempt()).await;
        assert_eq!(result.unwrap_err().kind(), ErrorKind::Timeout);
        assert_eq!(script.started.elapsed(), timeout);
        let at = script.at.borrow();
        assert!(at.iter().all(|t| *t < timeout), "{at:?}");
        // 0, then delays of 25–50, 50–100, 100–200, 200–400, 400–800, 500–1000 ms, …
        assert!((6..=11).contains(&at.len()), "{at:?}");
        let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(
            gaps.iter().all(|g| *g >= Duration::from_millis(25)),
            "{gaps:?}"
        );
        assert!(
            gaps.iter().all(|g| *g <= Duration::from_secs(1)),
            "{gaps:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_returns_the_lock_as_soon_as_an_attempt_takes_it() {
        let script = Script::new(vec![Ok(None), Ok(None), Ok(Some(7))]);
        let taken = until_taken(Duration::from_secs(30), delays(), || script.attempt()).await;
        assert_eq!(taken.unwrap(), 7);
        assert_eq!(script.at.borrow().len(), 3);
        assert!(script.started.elapsed() <= Duration::from_millis(150));
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_failure_ends_the_wait_with_that_failure() {
        let failure = LockError::new(ErrorKind::Unavailable, "no answer");
        let script = Script::new(vec![Ok(None), Err(failure), Ok(Some(1))]);
        let result = until_taken(Duration::from_secs(30), delays(), || script.attempt()).await;
        let error = result.unwrap_err();
        assert_eq!(
            (error.kind(), error.message()),
            (ErrorKind::Unavailable, "no answer")
        );
        assert_eq!(script.at.borrow().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_timeout_makes_one_attempt_and_the_longest_one_never_overflows() {
        let script = Script::new(Vec::new());
        let result = until_taken(Duration::ZERO, delays(), || script.attempt()).await;
        assert_eq!(result.unwrap_err().kind(), ErrorKind::Timeout);
        assert_eq!(script.at.borrow().len(), 1);

        let script = Script::new(vec![Ok(None), Ok(Some(3))]);
        let taken = until_taken(Duration::MAX, delays(), || script.attempt()).await;
        assert_eq!(taken.unwrap(), 3);
    }
}
