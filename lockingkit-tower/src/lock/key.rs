//! How a request names the lock it needs ([`LockKey`]) or the locks it needs together
//! ([`LockKeys`]).

use std::future::{ready, Future};

use http::request::Parts;

/// Derives the lock key of a request.
///
/// A [`LockLayer`](crate::LockLayer) asks its `LockKey` once per request, before acquiring.
/// `Some(key)` is the key to lock; `None` means no key can be derived from this request, which
/// the layer rejects with `400 Bad Request` (code `locking.invalid_key`) unless it was built
/// with [`pass_through_without_key`](crate::LockLayer::pass_through_without_key). Before that,
/// [`applies_to`](Self::applies_to) can take a request out of the layer's hands altogether.
///
/// Any `Fn(&Parts) -> Option<String>` is a `LockKey`. Implement the trait yourself when the key
/// needs mutable access to the request head or has to await something, as extractors of web
/// frameworks do: both methods are `async`, and the layer awaits them inside its response
/// future, so an extractor that is not ready at once is waited for, never mistaken for a
/// missing key.
///
/// Keys routinely carry customer ids: the layer never puts them in responses or logs.
///
/// ```
/// use http::request::Parts;
/// use lockingkit_tower::LockKey;
///
/// /// Locks per tenant, named by a header.
/// struct TenantKey;
///
/// impl LockKey for TenantKey {
///     async fn lock_key(&self, request: &mut Parts) -> Option<String> {
///         let tenant = request.headers.get("x-tenant")?.to_str().ok()?;
///         Some(format!("tenants/{tenant}"))
///     }
/// }
/// ```
pub trait LockKey: Send + Sync + 'static {
    /// The key to lock for this request, or `None` if the request does not name one.
    fn lock_key(&self, request: &mut Parts) -> impl Future<Output = Option<String>> + Send;

    /// Whether the layer handles this request at all; asked before [`lock_key`](Self::lock_key).
    ///
    /// A request this returns `false` for goes to the inner service unlocked, unrefused and
    /// without a [`LockView`](lockingkit::LockView), whatever the layer's configuration. A
    /// router's integration uses it for requests that matched no route, so that the router's
    /// fallback still answers them (`404` stays `404`). The default is `true`.
    fn applies_to(&self, request: &mut Parts) -> impl Future<Output = bool> + Send {
        let _ = request;
        ready(true)
    }

    /// Why the service is wired so that this request cannot be locked, if it is; asked before
    /// [`lock_key`](Self::lock_key) for requests the layer [applies to](Self::applies_to).
    ///
    /// A wiring mistake is a bug in the server, not in the request: the layer answers `500`
    /// and logs the explanation (once per layer and explanation), instead of a `400` that
    /// blames the client on every request. The explanation must not contain the key or any
    /// request data; a route template and parameter names are fine. For example
    /// [`PathTemplate`](https://docs.rs/lockingkit-axum) reports a template that names a path
    /// parameter its route does not capture. The default finds nothing.
    fn miswired(&self, request: &mut Parts) -> impl Future<Output = Option<String>> + Send {
        let _ = request;
        ready(None)
    }
}

impl<F> LockKey for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn lock_key(&self, request: &mut Parts) -> impl Future<Output = Option<String>> + Send {
        ready(self(request))
    }
}

/// Derives the keys a request locks together, for [`LockLayer::all`](crate::LockLayer::all)
/// and [`LockLayer::with_keys`](crate::LockLayer::with_keys).
///
/// The multi-key form of [`LockKey`](crate::LockKey), with the same three questions:
/// `Some(keys)` are the keys to hold as one (in any order, duplicates allowed: they are taken
/// in their canonical order and folded, see
/// [`DistributedLock::acquire_all`](lockingkit::DistributedLock::acquire_all)); `None`, or no
/// keys at all, means the request names none, which the layer rejects with `400` unless built
/// with [`pass_through_without_key`](crate::LockLayer::pass_through_without_key).
///
/// Any `Fn(&Parts) -> Option<Vec<String>>` is a `LockKeys`.
pub trait LockKeys: Send + Sync + 'static {
    /// The keys to lock together for this request, or `None` if the request names none.
    fn lock_keys(&self, request: &mut Parts) -> impl Future<Output = Option<Vec<String>>> + Send;

    /// Whether the layer handles this request at all (see
    /// [`LockKey::applies_to`](crate::LockKey::applies_to)). The default is `true`.
    fn applies_to(&self, request: &mut Parts) -> impl Future<Output = bool> + Send {
        let _ = request;
        ready(true)
    }

    /// Why the service is wired so that this request cannot be locked, if it is (see
    /// [`LockKey::miswired`](crate::LockKey::miswired)). The default finds nothing.
    fn miswired(&self, request: &mut Parts) -> impl Future<Output = Option<String>> + Send {
        let _ = request;
        ready(None)
    }
}

impl<F> LockKeys for F
where
    F: Fn(&Parts) -> Option<Vec<String>> + Send + Sync + 'static,
{
    fn lock_keys(&self, request: &mut Parts) -> impl Future<Output = Option<Vec<String>>> + Send {
        ready(self(request))
    }
}
