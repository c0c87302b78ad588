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
    /// The loss signal is polled before the work on every poll, so work is never resumed once
    /// the lock is gone, even when both became ready together. (tokio-util's
    /// `run_until_cancelled` prefers the work in that race, which is why it is not used.)
    pub(crate) struct UntilLost<F> {
        #[pin]
        lost: WaitForCancellationFutureOwned,
        #[pin]
        work: F,
    }
}

impl<F> UntilLost<F> {
    pub(crate) fn new(lost: CancellationToken, work: F) -> Self {
        UntilLost {
            lost: lost.cancelled_owned(),
            work,
        }
    }
}

impl<F: Future> Future for UntilLost<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if this.lost.poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        this.work.poll(cx).map(Some)
    }
}
