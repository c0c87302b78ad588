//! Futures that finish in the background when their caller goes away.
//!
//! Cancellation in async Rust is dropping a future. A backend attempt that is dropped after its
//! request left may still have taken the lock, and a release that is dropped half-way may have
//! left it held. `Orphanable` keeps such work alive: if the caller drops it before it finishes,
//! the work moves to a background task, runs to the end, and its result goes to a clean-up step
//! (for an attempt: release whatever lease it won).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A boxed, sendable future: what the engine hands through `dyn` boundaries.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What to do with the output of work whose caller went away.
pub(crate) trait Cleanup<T>: Send + 'static {
    fn clean_up(self, output: T) -> BoxFuture<'static, ()>;
}

/// The clean-up of work that needs none: running to the end is enough.
pub(crate) struct NoCleanup;

impl<T> Cleanup<T> for NoCleanup {
    fn clean_up(self, _output: T) -> BoxFuture<'static, ()> {
        Box::pin(async {})
    }
}

/// The clean-up is stored inline (not boxed): this sits on every acquire's hot path.
pub(crate) struct Orphanable<T: Send + 'static, C: Cleanup<T> = NoCleanup> {
    work: Option<BoxFuture<'static, T>>,
    cleanup: Option<C>,
}

impl<T: Send + 'static, C: Cleanup<T>> Orphanable<T, C> {
    /// `cleanup` runs on the result only if the caller dropped the future before it finished.
    #[inline]
    pub(crate) fn new(work: impl Future<Output = T> + Send + 'static, cleanup: C) -> Self {
        Orphanable {
            work: Some(Box::pin(work)),
            cleanup: Some(cleanup),
        }
    }
}

impl<T: Send + 'static> Orphanable<T> {
    /// Work that needs no clean-up, only to run to the end.
    #[inline]
    pub(crate) fn finishing(work: impl Future<Output = T> + Send + 'static) -> Self {
        Orphanable {
            work: Some(Box::pin(work)),
            cleanup: None,
        }
    }
}

// Nothing is pinned structurally: the work is boxed and the clean-up is only moved out.
impl<T: Send + 'static, C: Cleanup<T>> Unpin for Orphanable<T, C> {}

impl<T: Send + 'static, C: Cleanup<T>> Future for Orphanable<T, C> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(work) = self.work.as_mut() else {
            // Polled after completion: stay pending rather than panic; nothing will wake it.
            return Poll::Pending;
        };
        match work.as_mut().poll(cx) {
            Poll::Ready(output) => {
                self.work = None;
                self.cleanup = None;
                Poll::Ready(output)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: Send + 'static, C: Cleanup<T>> Drop for Orphanable<T, C> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else {
            return;
        };
        let cleanup = self.cleanup.take();
        // Without a runtime the work cannot finish; dropping it is all that is left, and the
        // backend frees the lock when the lease expires or the connection closes.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let output = work.await;
                if let Some(cleanup) = cleanup {
                    cleanup.clean_up(output).await;
                }
            });
        }
    }
}

/// Runs `work` with a time limit, arming the timer only if the work does not finish on its
/// first poll: most releases and in-memory calls complete at once, and a timer (a clock read
/// and a timer-wheel entry) would be most of their cost. `None` means the limit passed.
pub(crate) async fn within<F: Future>(limit: std::time::Duration, work: F) -> Option<F::Output> {
    within_noting(limit, work, || {}, (limit, || {})).await
}

/// [`within`], calling `pending` once if the work does not finish on its first poll (a request
/// that is on its way rather than answered at once), and `overdue` once if it is still
/// unanswered after `patience` (the work goes on until the limit).
pub(crate) async fn within_noting<F: Future>(
    limit: std::time::Duration,
    work: F,
    pending: impl FnOnce(),
    (patience, overdue): (std::time::Duration, impl FnOnce()),
) -> Option<F::Output> {
    let mut work = std::pin::pin!(work);
    let first = std::future::poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx))).await;
    match first {
        Poll::Ready(output) => Some(output),
        Poll::Pending if patience >= limit => {
            pending();
            tokio::time::timeout(limit, work).await.ok()
        }
        Poll::Pending => {
            pending();
            let end = crate::clock::in_(limit);
            if let Ok(output) = tokio::time::timeout(patience, work.as_mut()).await {
                return Some(output);
            }
            overdue();
            tokio::time::timeout_at(end, work).await.ok()
        }
    }
}

/// Runs `work` inside `span` only when the span is enabled, which saves entering and leaving
/// a disabled span on every poll.
pub(crate) async fn traced<F: Future>(span: tracing::Span, work: F) -> F::Output {
    use tracing::Instrument;
    if span.is_disabled() {
        work.await
    } else {
        work.instrument(span).await
    }
}
