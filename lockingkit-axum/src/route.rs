//! Route helpers: a lock per route, keyed by a template over the path parameters.

use std::time::Duration;

use axum::extract::FromRef;
use lockingkit::DistributedLock;
use lockingkit_tower::LockLayer;

use crate::PathTemplate;

/// A layer that locks `template` (e.g. `"orders/{id}"`) filled from the route's path
/// parameters, for `Router::route_layer` (or `Router::layer`).
///
/// One attempt per request: a busy lock is `409` with code `locking.busy`. The returned
/// [`LockLayer`] can be configured further, e.g. [`wait`](LockLayer::wait),
/// [`hold_until_body_ends`](LockLayer::hold_until_body_ends) or
/// [`map_rejection`](LockLayer::map_rejection). See [`PathTemplate`] for the template syntax.
///
/// The key is held exclusively by default. [`shared`](LockLayer::shared) makes it a reader's
/// hold, for reading routes that may run together (writers still run alone), and
/// [`semaphore`](LockLayer::semaphore) makes the layer a fleet-wide limit of `n` requests per
/// key, answering `429` when full. Both return a `Result`: a provider that cannot hold such
/// locks (Azure) is refused when the router is built, never by locking exclusively instead:
///
/// ```
/// use axum::{routing::{get, post}, Router};
/// use lockingkit::DistributedLock;
/// use lockingkit_axum::lock_route;
///
/// # fn main() -> Result<(), lockingkit::LockError> {
/// let locks = DistributedLock::in_memory();
/// let app: Router = Router::new()
///     .route(
///         "/catalog/{sku}",
///         get(|| async { "price" })
///             .route_layer(lock_route(locks.clone(), "catalog/{sku}").shared()?),
///     )
///     // At most 3 exports per tenant at once; the 4th gets 429 with `Retry-After`.
///     .route(
///         "/tenants/{tenant}/export",
///         post(|| async { "exported" })
///             .route_layer(lock_route(locks, "exports/{tenant}").semaphore(3)?),
///     );
/// # let _ = app;
/// # Ok(()) }
/// ```
///
/// `Router::route_layer` wraps every route added *before* it, so routes that need different
/// locks (or one lock in different modes) each take theirs on the method router:
/// `post(ship).route_layer(lock_route(…))`. Two layers of one provider locking the same key on
/// one request are a wiring mistake (locks are not reentrant): such requests are answered
/// `500` (`locking.misconfigured`) before any lock is taken, and the mistake is logged once.
///
/// `Router::layer` also wraps the router's fallback, on merged and nested routers too. A
/// request that matched no route passes through such a layer unlocked, so the fallback's
/// answer stands (`404` stays `404`). A route that does not capture a parameter the template
/// names (a typo such as `{Id}` for `{id}`) is refused with `500` (`locking.misconfigured`)
/// and one logged error naming the template, the route and the parameter, rather than served
/// unlocked or blamed on the client: with `Router::layer`, every route of the router needs the
/// template's parameters, so routes of other shapes belong outside it or behind their own
/// `route_layer`.
///
/// ```
/// use std::time::Duration;
/// use axum::{extract::Path, routing::{get, post}, Router};
/// use lockingkit::DistributedLock;
/// use lockingkit_axum::{lock_route, lock_route_waiting, HeldLock};
///
/// async fn pay(Path(id): Path<String>, lock: HeldLock) -> String {
///     format!("paid {id} under token {}", lock.fencing_token())
/// }
///
/// let locks = DistributedLock::in_memory();
/// let app: Router = Router::new()
///     // Only the routes above `route_layer` are locked …
///     .route("/orders/{id}/pay", post(pay))
///     .route_layer(lock_route(locks.clone(), "orders/{id}"))
///     // … so reads stay lock-free.
///     .route("/orders/{id}", get(|| async { "order" }))
///     // A route with its own lock mode takes it on its method router.
///     .route(
///         "/orders/{id}/refund",
///         post(pay).route_layer(lock_route_waiting(locks, "orders/{id}", Duration::from_secs(5))),
///     );
/// # let _ = app;
/// ```
pub fn lock_route(locks: DistributedLock, template: &str) -> LockLayer {
    LockLayer::with_key(locks, PathTemplate::new(template))
}

/// Like [`lock_route`], but waits up to `timeout` for a busy lock; a wait that ends busy is
/// `409` with code `locking.timeout`.
pub fn lock_route_waiting(locks: DistributedLock, template: &str, timeout: Duration) -> LockLayer {
    lock_route(locks, template).wait(timeout)
}

/// Like [`lock_route`], with the lock provider taken from the application state.
///
/// The state provides it through a [`FromRef`] impl for [`DistributedLock`] — the same impl
/// that lets handlers extract `State<DistributedLock>` (see [`ProvidesLocks`]):
///
/// ```
/// use axum::{extract::FromRef, routing::post, Router};
/// use lockingkit::DistributedLock;
/// use lockingkit_axum::lock_route_from_state;
///
/// #[derive(Clone)]
/// struct AppState {
///     locks: DistributedLock,
/// }
///
/// impl FromRef<AppState> for DistributedLock {
///     fn from_ref(state: &AppState) -> Self {
///         state.locks.clone()
///     }
/// }
///
/// let state = AppState { locks: DistributedLock::in_memory() };
/// let app: Router = Router::new()
///     .route("/orders/{id}/ship", post(|| async { "shipped" }))
///     .route_layer(lock_route_from_state(&state, "orders/{id}"))
///     .with_state(state);
/// # let _ = app;
/// ```
///
/// Without that impl the call does not compile, and the error names the missing impl: "the
/// trait bound `DistributedLock: FromRef<AppState>` is not satisfied".
///
/// ```compile_fail,E0277
/// use lockingkit::DistributedLock;
/// use lockingkit_axum::lock_route_from_state;
///
/// #[derive(Clone)]
/// struct AppState {
///     locks: DistributedLock,
/// }
///
/// let state = AppState { locks: DistributedLock::in_memory() };
/// let _ = lock_route_from_state(&state, "orders/{id}"); // no `FromRef<AppState>` impl
/// ```
pub fn lock_route_from_state<S: ProvidesLocks>(state: &S, template: &str) -> LockLayer {
    lock_route(state.distributed_lock(), template)
}

/// Application state that provides the [`DistributedLock`], for [`lock_route_from_state`].
///
/// Implemented for every state `S` for which `DistributedLock` implements [`FromRef<S>`]:
/// write that impl, never this trait. The trait exists so that a state without the impl is
/// reported as such; with a bare `DistributedLock: FromRef<S>` bound, the compiler inferred
/// `S = DistributedLock` from axum's `FromRef<T> for T` and reported "expected
/// `&DistributedLock`, found `&AppState`".
pub trait ProvidesLocks {
    /// The lock provider held by this state.
    fn distributed_lock(&self) -> DistributedLock;
}

impl<S> ProvidesLocks for S
where
    DistributedLock: FromRef<S>,
{
    fn distributed_lock(&self) -> DistributedLock {
        DistributedLock::from_ref(self)
    }
}
