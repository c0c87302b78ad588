//! `UntilLost`: work raced against a lock's loss signal, loss first.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use lockingkit::CancellationToken;
use pin_project_lite::pin_project;
use tokio_util::sync::WaitForCancellationFutureOwned;

pin_project! {
    /// Runs `work` until it finishes (`Some(output)`) or `lost` is cancelled (`None`), at which
    /// point `work` is dropped by the owner of this future.
    ///
    /// Loss is checked before the work on every poll, so work is never resumed once the lock
    /// is gone, even when both became ready together. (tokio-util's `run_until_cancelled`
    /// prefers the work in that race, which is why it is not used.)
    pub(crate) struct UntilLost<F> {
        // `None`: the work is never dropped on loss (`OnLoss::Signal`).
        lost: Option<CancellationToken>,
        // Registered only once the work has returned `Pending`: most handlers behind the layer
        // finish in their first poll, and registering and removing a waiter costs two lock
        // round trips on the token (benchmark row 9, HTTP layer cost).
        #[pin]
        waiter: Option<WaitForCancellationFutureOwned>,
        #[pin]
        work: F,
    }
}

impl<F> UntilLost<F> {
    pub(crate) fn new(lost: Option<CancellationToken>, work: F) -> Self {
        UntilLost {
            lost,
            waiter: None,
            work,
        }
    }
}

impl<F: Future> Future for UntilLost<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let Some(token) = this.lost.as_ref() else {
            return this.work.poll(cx).map(Some);
        };
        let lost = match this.waiter.as_mut().as_pin_mut() {
            Some(waiter) => waiter.poll(cx).is_ready(),
            None => token.is_cancelled(),
        };
        if lost {
            return Poll::Ready(None);
        }
        if let Poll::Ready(output) = this.work.poll(cx) {
            return Poll::Ready(Some(output));
        }
        // The work waits, so loss must wake this task from now on.
        if this.waiter.is_none() {
            this.waiter.set(Some(token.clone().cancelled_owned()));
        }
        match this.waiter.as_pin_mut().map(|waiter| waiter.poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(None),
            _ => Poll::Pending,
        }
    }
}
