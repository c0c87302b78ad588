//! `UntilLost`: work raced against a lock's loss, loss first.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::handle::Handle;

pin_project! {
    /// Runs `work` until it finishes (`Some(output)`) or the hold it runs under is lost
    /// (`None`), at which point `work` is dropped by the owner of this future.
    ///
    /// Loss is checked before the work on every poll, so work is never resumed once the lock
    /// is gone, even when both became ready together. (tokio-util's `run_until_cancelled`
    /// prefers the work in that race, which is why it is not used.)
    pub(crate) struct UntilLost<F> {
        // The hold's loss signal, asked for only once the work has returned `Pending`: most
        // handlers behind the layer finish in their first poll, and the signal costs the hold
        // a token of its own and a child token for this request (two allocations), and waiting
        // on it two lock round trips (benchmark row 9, HTTP layer cost). Until then loss is
        // read from the hold itself, which also counts a passed loss deadline.
        #[pin]
        waiter: Option<WaitForCancellationFutureOwned>,
        #[pin]
        work: F,
    }
}

impl<F> UntilLost<F> {
    pub(crate) fn new(work: F) -> Self {
        UntilLost { waiter: None, work }
    }
}

impl<F: Future> UntilLost<F> {
    /// Polls the work under `hold`; `None` for work that loss never drops
    /// (`OnLoss::Signal`).
    pub(crate) fn poll_under(
        self: Pin<&mut Self>,
        hold: Option<&Handle>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<F::Output>> {
        let mut this = self.project();
        let Some(hold) = hold else {
            return this.work.poll(cx).map(Some);
        };
        let lost = match this.waiter.as_mut().as_pin_mut() {
            Some(waiter) => waiter.poll(cx).is_ready(),
            None => !hold.is_held(),
        };
        if lost {
            return Poll::Ready(None);
        }
        if let Poll::Ready(output) = this.work.poll(cx) {
            return Poll::Ready(Some(output));
        }
        // The work waits, so loss must wake this task from now on.
        if this.waiter.is_none() {
            this.waiter.set(Some(hold.loss_signal().cancelled_owned()));
        }
        match this.waiter.as_pin_mut().map(|waiter| waiter.poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(None),
            _ => Poll::Pending,
        }
    }
}
