//! Axum integration for [LockingKit](lockingkit) distributed locks.
//!
//! - [`lock_route`] builds a [`LockLayer`] whose key is a template over the route's path
//!   parameters (`"orders/{id}"`), for `Router::route_layer` (or `Router::layer`: a request
//!   that matches no route passes through unlocked, so `404` stays `404`). Each request takes
//!   the lock before the handler runs; a busy lock is `409 Conflict` as an RFC 9457 problem
//!   document with code `locking.busy`; an outage is `503` (`locking.unavailable`), never
//!   `409`; if the lock is lost while the handler runs, the handler's future is dropped and
//!   the client gets `500` with code `locking.lost`, saying the outcome is unknown (or, with
//!   [`on_loss(OnLoss::Signal)`](LockLayer::on_loss), the handler runs on and is told).
//!   [`lock_route_waiting`] waits for the lock instead.
//! - `lock_route(…).shared()?` lets reading routes hold the key together while writing routes
//!   (the default, exclusive) hold it alone, and `lock_route(…).semaphore(n)?` caps the
//!   requests per key across the fleet (a full limit is `429` with code `locking.busy`). Both
//!   refuse, when the layer is built, a provider that cannot hold such locks.
//! - [`HeldLock`] is the extractor that gives the handler the view of its lock
//!   ([`LockView`](lockingkit::LockView)): the key, the mode, the fencing token and the loss
//!   signal. [`HeldLocks`] does the same for the keys of [`lock_route_all`].
//! - [`lock_route_from_state`] takes the `DistributedLock` from the application state through
//!   [`FromRef`](axum::extract::FromRef); handlers that lock other keys themselves can extract
//!   `State<DistributedLock>` the same way.
//! - [`Readiness`] is a readiness endpoint for the lock providers, to mount with
//!   `Router::route_service("/ready", Readiness::new(&locking))`.
//!
//! ```
//! use axum::{extract::Path, routing::post, Router};
//! use lockingkit::DistributedLock;
//! use lockingkit_axum::{lock_route, HeldLock};
//!
//! async fn ship(Path(id): Path<u64>, lock: HeldLock) -> String {
//!     format!("order {id} shipped, fencing token {}", lock.fencing_token())
//! }
//!
//! let app: Router = Router::new()
//!     .route("/orders/{id}/ship", post(ship))
//!     .route_layer(lock_route(DistributedLock::in_memory(), "orders/{id}"));
//! # let _ = app;
//! ```
//!
//! Reads of an order can run together while a write waits for them:
//!
//! ```
//! use std::time::Duration;
//! use axum::{extract::Path, routing::{get, post}, Router};
//! use lockingkit::DistributedLock;
//! use lockingkit_axum::{lock_route, lock_route_waiting, HeldLock};
//!
//! async fn show(Path(id): Path<u64>) -> String {
//!     format!("order {id}")
//! }
//!
//! async fn ship(Path(id): Path<u64>, lock: HeldLock) -> String {
//!     format!("order {id} shipped, fencing token {}", lock.fencing_token())
//! }
//!
//! # fn main() -> Result<(), lockingkit::LockError> {
//! const WAIT: Duration = Duration::from_secs(10);
//! let locks = DistributedLock::in_memory();
//! let app: Router = Router::new()
//!     // Fails here, not per request, if the provider cannot hold shared locks.
//!     .route(
//!         "/orders/{id}",
//!         get(show).route_layer(lock_route(locks.clone(), "orders/{id}").shared()?),
//!     )
//!     .route(
//!         "/orders/{id}/ship",
//!         // Waits up to 10 s for the reads in flight, then ships alone.
//!         post(ship).route_layer(lock_route_waiting(locks, "orders/{id}", WAIT)),
//!     );
//! # let _ = app;
//! # Ok(()) }
//! ```
//!
//! Everything about the lock itself — modes, rejections, body holding, custom responses — is
//! configured on the returned [`LockLayer`], documented in `lockingkit-tower`.
//!
//! A [`LockRejection`] is axum's `IntoResponse` (the RFC 9457 problem document), so a rejection
//! mapper can answer some cases itself and hand the rest back, and a handler that takes another
//! lock itself can answer as the layer would with `?`:
//!
//! ```
//! use axum::{extract::State, http::StatusCode, response::IntoResponse, routing::post, Router};
//! use lockingkit::{DistributedLock, ErrorKind};
//! use lockingkit_axum::{lock_route, HeldLock, LockRejection};
//!
//! async fn reserve(
//!     State(locks): State<DistributedLock>,
//!     lock: HeldLock,
//! ) -> Result<String, LockRejection> {
//!     // Busy stock is `409` with code `locking.busy`, like a busy order.
//!     let stock = locks.try_acquire("inventory/widgets").await?;
//!     stock.release().await?;
//!     Ok(format!("reserved under fencing token {}", lock.fencing_token()))
//! }
//!
//! let locks = DistributedLock::in_memory();
//! let layer = lock_route(locks.clone(), "orders/{id}").map_rejection(|rejection: LockRejection| {
//!     match rejection.kind() {
//!         ErrorKind::Busy => (StatusCode::TOO_MANY_REQUESTS, "try again").into_response(),
//!         _ => rejection.into_response(),
//!     }
//! });
//! let app: Router = Router::new()
//!     .route("/orders/{id}/reserve", post(reserve))
//!     .route_layer(layer)
//!     .with_state(locks);
//! # let _ = app;
//! ```

#![deny(missing_docs)]
#![forbid(unsafe_code)]
#![warn(unreachable_pub)]

pub mod extract;
mod key_templates;
mod route;
mod template;

pub use extract::rejection::MissingLock;
pub use extract::{HeldLock, HeldLocks};
pub use key_templates::{lock_route_all, KeyTemplates};
pub use lockingkit_tower::{LockLayer, LockRejection, OnLoss, Readiness};
pub use route::{lock_route, lock_route_from_state, lock_route_waiting, ProvidesLocks};
pub use template::PathTemplate;

/// The HTTP guide's examples, compiled as doc tests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../docs/http.md")]
pub struct HttpGuideDoctests;

/// The crate README's example, compiled as a doc test so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
