//! How a request names the lock it needs.

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
/// needs mutable access to the request head, as extractors of web frameworks do.
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
///     fn lock_key(&self, request: &mut Parts) -> Option<String> {
///         let tenant = request.headers.get("x-tenant")?.to_str().ok()?;
///         Some(format!("tenants/{tenant}"))
///     }
/// }
/// ```
pub trait LockKey: Send + Sync + 'static {
    /// The key to lock for this request, or `None` if the request does not name one.
    fn lock_key(&self, request: &mut Parts) -> Option<String>;

    /// Whether the layer handles this request at all; asked before [`lock_key`](Self::lock_key).
    ///
    /// A request this returns `false` for goes to the inner service unlocked, unrefused and
    /// without a [`RequestLock`](crate::RequestLock), whatever the layer's configuration. A
    /// router's integration uses it for requests that matched no route, so that the router's
    /// fallback still answers them (`404` stays `404`). The default is `true`.
    fn applies_to(&self, request: &mut Parts) -> bool {
        let _ = request;
        true
    }
}

impl<F> LockKey for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn lock_key(&self, request: &mut Parts) -> Option<String> {
        self(request)
    }
}
