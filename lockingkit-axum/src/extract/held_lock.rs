//! `HeldLock`: the extractor for the view of the lock held for the request.

use std::convert::Infallible;
use std::ops::Deref;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;
use lockingkit::LockView;

use super::rejection::MissingLock;

/// Extractor for the lock a lock layer holds for this request: its [`LockView`] (key, mode,
/// fencing token, loss signal), reached through `Deref`.
///
/// The route must be behind a [`LockLayer`](lockingkit_tower::LockLayer), usually through
/// [`lock_route`](crate::lock_route) on `Router::route_layer`; otherwise the extractor rejects
/// with [`MissingLock`] (`500`). Extract `Option<HeldLock>` in handlers that run both with and
/// without a lock.
///
/// Behind a [`shared`](lockingkit_tower::LockLayer::shared) layer it is the request's reader
/// hold, behind a [`semaphore`](lockingkit_tower::LockLayer::semaphore) layer its slot;
/// [`mode`](LockView::mode) tells which. Each is released when the response is produced and
/// watched for loss exactly like an exclusive lock.
///
/// If the lock is lost while the handler runs, the layer drops the handler's future and the
/// client gets `500` with code `locking.lost`, saying the outcome is unknown; the handler does
/// not need to watch for loss itself (with
/// [`on_loss(OnLoss::Signal)`](lockingkit_tower::LockLayer::on_loss) it runs on instead, and
/// this extractor tells it of the loss). Send [`fencing_token`](LockView::fencing_token) with
/// every write to a resource that can reject stale tokens, and tie spawned work to
/// [`lost_token`](LockView::lost_token) or [`run`](LockView::run): the token fires on loss and
/// also when the layer releases the lock after the response.
///
/// ```
/// use axum::{extract::Path, routing::post, Router};
/// use lockingkit::DistributedLock;
/// use lockingkit_axum::{lock_route, HeldLock};
///
/// async fn ship(Path(id): Path<u64>, lock: HeldLock) -> String {
///     // `lock.key()` is "orders/{id}"; the token fences writes made under this lock.
///     format!("shipped order {id} with fencing token {}", lock.fencing_token())
/// }
///
/// let locks = DistributedLock::in_memory();
/// let app: Router = Router::new()
///     .route("/orders/{id}/ship", post(ship))
///     .route_layer(lock_route(locks, "orders/{id}"));
/// # let _ = app;
/// ```
#[derive(Clone, Debug)]
pub struct HeldLock(pub LockView);

impl HeldLock {
    /// The view of the request's lock, for storing or passing on.
    pub fn into_inner(self) -> LockView {
        self.0
    }
}

impl Deref for HeldLock {
    type Target = LockView;

    fn deref(&self) -> &LockView {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HeldLock {
    type Rejection = MissingLock;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<LockView>()
            .cloned()
            .map(HeldLock)
            .ok_or(MissingLock)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for HeldLock {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<LockView>().cloned().map(HeldLock))
    }
}
