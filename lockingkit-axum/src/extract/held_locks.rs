//! `HeldLocks`: the extractor for the view of the keys held together for the request.

use std::convert::Infallible;
use std::ops::Deref;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;
use lockingkit::MultiLockView;

use super::rejection::MissingLock;

/// Extractor for the keys a multi-key lock layer holds together for this request (made by
/// [`lock_route_all`](crate::lock_route_all) or
/// [`LockLayer::all`](lockingkit_tower::LockLayer::all)): the hold's [`MultiLockView`] (each
/// member's key and fencing token, the mode, the hold's loss signal), reached through `Deref`.
///
/// Without such a layer the extractor rejects with [`MissingLock`] (`500`). Extract
/// `Option<HeldLocks>` in handlers that run both with and without one. If any key is lost
/// while the handler runs, the layer drops the handler, as for a single lock.
///
/// ```
/// use axum::{routing::post, Router};
/// use lockingkit::DistributedLock;
/// use lockingkit_axum::{lock_route_all, HeldLocks};
///
/// async fn transfer(locks: HeldLocks) -> String {
///     let tokens: Vec<u64> = locks.members().iter().map(|m| m.fencing_token()).collect();
///     format!("moved under tokens {tokens:?}")
/// }
///
/// let app: Router = Router::new()
///     .route("/transfers/{from}/{to}", post(transfer))
///     .route_layer(lock_route_all(
///         DistributedLock::in_memory(),
///         &["accounts/{from}", "accounts/{to}"],
///     ));
/// # let _ = app;
/// ```
#[derive(Clone, Debug)]
pub struct HeldLocks(pub MultiLockView);

impl HeldLocks {
    /// The request's view of the hold, for storing or passing on.
    pub fn into_inner(self) -> MultiLockView {
        self.0
    }
}

impl Deref for HeldLocks {
    type Target = MultiLockView;

    fn deref(&self) -> &MultiLockView {
        &self.0
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HeldLocks {
    type Rejection = MissingLock;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<MultiLockView>()
            .cloned()
            .map(HeldLocks)
            .ok_or(MissingLock)
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for HeldLocks {
    type Rejection = Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<MultiLockView>()
            .cloned()
            .map(HeldLocks))
    }
}
