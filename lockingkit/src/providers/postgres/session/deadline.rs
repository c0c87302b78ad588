//! The deadline of one statement, armed only once the statement is pending.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use super::Session;

/// A timer for statements that run alone, moved forward for each: pushing a registered timer
/// later is an atomic update, while registering a fresh one per statement touches the timer
/// wheel and, when no other timer is pending, wakes the runtime's driver (see the PostgreSQL
/// rows of the benchmark, docs/performance.md). A statement sent while another holds it gets a
/// timer of its own.
pub(in crate::providers::postgres) struct SoloTimer {
    sleep: Mutex<Pin<Box<Sleep>>>,
    taken: AtomicBool,
}

impl SoloTimer {
    pub(in crate::providers::postgres) fn new() -> Self {
        SoloTimer {
            // Reset before every use; until then it only needs to be valid.
            sleep: Mutex::new(Box::pin(tokio::time::sleep(Duration::from_secs(3600)))),
            taken: AtomicBool::new(false),
        }
    }
}

impl Session {
    /// `statement`, failing with [`Elapsed`] if it does not finish within `timeout`, and
    /// counted as in flight meanwhile.
    pub(in crate::providers::postgres) fn bounded<F: Future>(
        &self,
        timeout: Duration,
        statement: F,
    ) -> Bounded<'_, F> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Bounded {
            statement,
            timer: Timer::Unarmed(crate::clock::in_(timeout)),
            session: self,
        }
    }
}

/// A statement that did not answer in time.
#[derive(Debug)]
pub(in crate::providers::postgres) struct Elapsed;

/// The deadline of one statement, armed once the statement is pending.
enum Timer {
    Unarmed(Instant),
    /// The session's solo timer, which this statement holds.
    Solo,
    Own(Pin<Box<Sleep>>),
}

pin_project_lite::pin_project! {
    /// A statement raced against its own deadline. The timer is armed only once the statement
    /// is pending, so a statement that answers on its first poll costs none.
    pub(in crate::providers::postgres) struct Bounded<'a, F> {
        #[pin]
        statement: F,
        timer: Timer,
        session: &'a Session,
    }

    impl<'a, F> PinnedDrop for Bounded<'a, F> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if matches!(this.timer, Timer::Solo) {
                this.session.solo_timer.taken.store(false, Ordering::Release);
            }
            this.session.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl<F: Future> Future for Bounded<'_, F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.statement.poll(cx) {
            return Poll::Ready(Ok(output));
        }
        let session = *this.session;
        if let Timer::Unarmed(deadline) = *this.timer {
            *this.timer = if session
                .solo_timer
                .taken
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                session
                    .solo_timer
                    .sleep
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .as_mut()
                    .reset(deadline);
                Timer::Solo
            } else {
                Timer::Own(Box::pin(tokio::time::sleep_until(deadline)))
            };
        }
        let elapsed = match this.timer {
            Timer::Own(sleep) => sleep.as_mut().poll(cx).is_ready(),
            Timer::Solo => session
                .solo_timer
                .sleep
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .as_mut()
                .poll(cx)
                .is_ready(),
            Timer::Unarmed(_) => false,
        };
        if elapsed {
            Poll::Ready(Err(Elapsed))
        } else {
            Poll::Pending
        }
    }
}
