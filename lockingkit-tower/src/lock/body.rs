//! `LockBody`: the response body of a locked service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use lockingkit::{ErrorKind, LockError};
use pin_project_lite::pin_project;
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::handle::Handle;
use crate::BoxError;

type Release = Pin<Box<dyn Future<Output = Result<(), LockError>> + Send>>;

pin_project! {
    /// The response body of a [`LockService`](crate::LockService): the inner service's body,
    /// or a rejection's body.
    ///
    /// When the layer was built with
    /// [`hold_until_body_ends`](crate::LockLayer::hold_until_body_ends), the body also holds the
    /// lock while it streams: the lock is released right after the last frame, before the body
    /// reports its end. If the lock is lost mid-stream, the body fails with a
    /// [`LockError`] of kind [`ErrorKind::Lost`] instead of sending more data, so the client
    /// sees a broken response rather than a complete-looking one; for a multi-key hold, it
    /// fails once the keys still held have been released. Dropping the body (a client
    /// that went away) releases the lock in the background.
    pub struct LockBody<B> {
        #[pin]
        kind: Kind<B>,
        hold: Option<Box<BodyHold>>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes> },
    }
}

struct BodyHold {
    handle: Option<Handle>,
    lost: Pin<Box<WaitForCancellationFutureOwned>>,
    release: Option<Release>,
    /// Set on loss: the body fails with it once the release has been answered.
    lost_error: Option<LockError>,
}

impl<B> LockBody<B> {
    /// Wraps the inner service's body.
    pub fn new(body: B) -> Self {
        LockBody {
            kind: Kind::Inner { body },
            hold: None,
        }
    }

    /// A body of `data` in one frame, as rejections use.
    pub fn full(data: Bytes) -> Self {
        LockBody {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
            hold: None,
        }
    }

    pub(crate) fn holding(body: B, handle: Handle) -> Self {
        let lost = Box::pin(handle.loss_signal().cancelled_owned());
        LockBody {
            kind: Kind::Inner { body },
            hold: Some(Box::new(BodyHold {
                handle: Some(handle),
                lost,
                release: None,
                lost_error: None,
            })),
        }
    }

    /// Whether this body still holds the request's lock.
    pub fn holds_lock(&self) -> bool {
        self.hold.as_ref().is_some_and(|hold| hold.handle.is_some())
    }
}

impl BodyHold {
    /// On loss mid-stream: the body fails with the loss once the release of what the hold
    /// still held (the other members of a multi-key hold) has been answered.
    fn start_abort(&mut self) {
        tracing::warn!(
            code = ErrorKind::Lost.code(),
            "lock lost while streaming the response body; aborting the body"
        );
        let error = self
            .handle
            .as_ref()
            .and_then(|handle| handle.ensure_held().err())
            .unwrap_or_else(|| LockError::lost(None));
        self.lost_error = Some(error);
        self.start_release();
    }

    fn start_release(&mut self) {
        self.release = Some(match self.handle.take() {
            Some(handle) => handle.release(),
            None => Box::pin(std::future::ready(Ok(()))),
        });
    }
}

/// Waits for the hold's release, then ends the body: with the loss if it was lost, cleanly
/// otherwise.
fn poll_release<D>(
    slot: &mut Option<Box<BodyHold>>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<D>, BoxError>>> {
    let Some(release) = slot.as_mut().and_then(|hold| hold.release.as_mut()) else {
        *slot = None;
        return Poll::Ready(None);
    };
    let result = ready!(release.as_mut().poll(cx));
    let lost_error = slot.take().and_then(|mut hold| hold.lost_error.take());
    Poll::Ready(match (lost_error, result) {
        (Some(lost), _) => Some(Err(lost.into())),
        (None, Err(error)) => {
            tracing::warn!(code = error.code(), error = %error, "releasing the lock after a streamed body failed");
            None
        }
        (None, Ok(())) => None,
    })
}

impl<B> Body for LockBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        if let Some(hold) = this.hold.as_mut() {
            if hold.release.is_none() && hold.lost.as_mut().poll(cx).is_ready() {
                hold.start_abort();
            }
            if hold.release.is_some() {
                return poll_release(this.hold, cx);
            }
        }
        let frame = match this.kind.as_mut().project() {
            KindProj::Inner { body } => ready!(body.poll_frame(cx)),
            KindProj::Full { data } => data.take().map(|data| Ok(Frame::data(data.into()))),
        };
        match frame {
            Some(Ok(frame)) => Poll::Ready(Some(Ok(frame))),
            Some(Err(error)) => {
                // The handle's drop releases in the background; the response is broken anyway.
                *this.hold = None;
                Poll::Ready(Some(Err(error.into())))
            }
            None => match this.hold.as_mut() {
                // Release before reporting the end, so a client that sees the whole body can
                // take the lock at once.
                Some(hold) => {
                    hold.start_release();
                    poll_release(this.hold, cx)
                }
                None => Poll::Ready(None),
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        // While the lock is held the end is reported only after the release has finished.
        let kind_ended = match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
        };
        kind_ended && self.hold.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |data| data.len() as u64))
            }
        }
    }
}

impl<B> fmt::Debug for LockBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockBody")
            .field("holds_lock", &self.holds_lock())
            .finish_non_exhaustive()
    }
}
