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

/// How long past a wait's deadline its last attempt may still answer. An attempt is one short
/// statement; without this, one that started just before the deadline would be cut off at
/// once, and a busy answer on its way would become an unknown outcome.
pub(super) const LAST_ANSWER_MARGIN: Duration = Duration::from_millis(250);

/// Runs `attempt` until it takes the lock, the wait of `timeout` ends, or an attempt fails.
///
/// Each attempt is given its bound: `query_timeout`, or the time left until the deadline plus
/// [`LAST_ANSWER_MARGIN`] when that is shorter, so a server that stops answering ends the wait
/// soon after its timeout, not a whole `query_timeout` later. Busy answers are followed by a
/// sleep from `delays`, never past the deadline; no attempt starts once the deadline has come,
/// and a wait that ends busy is [`ErrorKind::Timeout`](crate::ErrorKind::Timeout). The first
/// failure ends the wait: in a transaction, a failed statement aborts the transaction, so no
/// later attempt could succeed.
pub(super) async fn until_taken<T, F, A>(
    timeout: Duration,
    query_timeout: Duration,
    mut delays: Backoff,
    mut attempt: F,
) -> Result<T, LockError>
where
    F: FnMut(Duration) -> A,
    A: Future<Output = Result<Option<T>, LockError>>,
{
    let deadline = clock::in_(timeout);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let bound = query_timeout.min(left.saturating_add(LAST_ANSWER_MARGIN));
        if let Some(taken) = attempt(bound).await? {
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
        bounds: RefCell<Vec<Duration>>,
        answers: RefCell<Vec<Result<Option<u64>, LockError>>>,
    }

    impl Script {
        fn new(mut answers: Vec<Result<Option<u64>, LockError>>) -> Self {
            answers.reverse();
            Script {
                started: Instant::now(),
                at: RefCell::new(Vec::new()),
                bounds: RefCell::new(Vec::new()),
                answers: RefCell::new(answers),
            }
        }

        async fn attempt(&self, bound: Duration) -> Result<Option<u64>, LockError> {
            self.at.borrow_mut().push(self.started.elapsed());
            self.bounds.borrow_mut().push(bound);
            self.answers.borrow_mut().pop().unwrap_or(Ok(None))
        }

        /// A wait of at most `timeout` whose every attempt is this script's, with the query
        /// timeout and delays of every test here.
        async fn wait(&self, timeout: Duration) -> Result<u64, LockError> {
            until_taken(timeout, QUERY_TIMEOUT, delays(), |bound| {
                self.attempt(bound)
            })
            .await
        }
    }

    const QUERY_TIMEOUT: Duration = Duration::from_secs(5);

    fn delays() -> Backoff {
        Backoff::new(Duration::from_millis(50), Duration::from_secs(1))
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_that_stays_busy_ends_in_timeout_at_its_deadline_with_no_attempt_after_it() {
        let script = Script::new(Vec::new());
        let timeout = Duration::from_millis(3500);
        let result = script.wait(timeout).await;
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
        let taken = script.wait(Duration::from_secs(30)).await;
        assert_eq!(taken.unwrap(), 7);
        assert_eq!(script.at.borrow().len(), 3);
        assert!(script.started.elapsed() <= Duration::from_millis(150));
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_failure_ends_the_wait_with_that_failure() {
        let failure = LockError::new(ErrorKind::Unavailable, "no answer");
        let script = Script::new(vec![Ok(None), Err(failure), Ok(Some(1))]);
        let result = script.wait(Duration::from_secs(30)).await;
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
        let result = script.wait(Duration::ZERO).await;
        assert_eq!(result.unwrap_err().kind(), ErrorKind::Timeout);
        assert_eq!(script.at.borrow().len(), 1);

        let script = Script::new(vec![Ok(None), Ok(Some(3))]);
        let taken = script.wait(Duration::MAX).await;
        assert_eq!(taken.unwrap(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn each_attempt_is_bounded_by_the_time_left_plus_a_margin_or_the_query_timeout() {
        let script = Script::new(Vec::new());
        let timeout = Duration::from_millis(3500);
        let result = script.wait(timeout).await;
        assert_eq!(result.unwrap_err().kind(), ErrorKind::Timeout);
        {
            let (at, bounds) = (script.at.borrow(), script.bounds.borrow());
            for (at, bound) in at.iter().zip(bounds.iter()) {
                let expected = QUERY_TIMEOUT.min(timeout - *at + LAST_ANSWER_MARGIN);
                assert_eq!(*bound, expected, "attempt at {at:?}");
            }
            assert!(bounds.iter().any(|b| *b < QUERY_TIMEOUT), "{bounds:?}");
        }

        let script = Script::new(vec![Ok(Some(1))]);
        script.wait(Duration::MAX).await.unwrap();
        assert_eq!(*script.bounds.borrow(), [QUERY_TIMEOUT]);
    }
}
