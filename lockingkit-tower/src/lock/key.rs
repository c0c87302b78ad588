//! How a request names the lock it needs, and the one boxed future per request that derives
//! the key and takes the lock.

use std::future::{ready, Future};
use std::pin::Pin;
use std::sync::Arc;

use http::request::Parts;
use lockingkit::LockError;

use super::held::Held;
use super::keys::{held_by_an_outer_layer, NESTED};
use super::layer::LockConfig;

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
    /// without a [`RequestLock`](crate::RequestLock), whatever the layer's configuration. A
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

/// What deriving the key and taking the lock came to, for one request.
pub(crate) enum Derived {
    /// [`LockKey::applies_to`] said no: the request goes on unlocked.
    NotApplicable,
    /// No key could be derived.
    NoKey,
    Acquired {
        handle: Held,
    },
    Refused {
        error: LockError,
    },
    /// The service is wired so that the request cannot be locked: a server bug, told here.
    Miswired {
        explanation: String,
    },
}

pub(crate) type Acquisition = Pin<Box<dyn Future<Output = (Parts, Derived)> + Send>>;

/// A [`LockKey`] with its type erased, so that the layer can hold any key: it boxes the whole
/// per-request work (key derivation and acquisition) in one allocation.
pub(crate) trait AcquireForRequest: Send + Sync + 'static {
    /// Takes `parts` for the duration and hands them back with the outcome.
    /// The layer's `config` says on which provider, in which mode and how long to wait.
    fn acquire_for(self: Arc<Self>, parts: Parts, config: Arc<LockConfig>) -> Acquisition;
}

impl<K: LockKey> AcquireForRequest for K {
    fn acquire_for(self: Arc<Self>, mut parts: Parts, config: Arc<LockConfig>) -> Acquisition {
        Box::pin(async move {
            let derived = derive_and_acquire(&*self, &mut parts, &config).await;
            (parts, derived)
        })
    }
}

async fn derive_and_acquire<K: LockKey>(
    key: &K,
    parts: &mut Parts,
    config: &LockConfig,
) -> Derived {
    if !key.applies_to(parts).await {
        return Derived::NotApplicable;
    }
    if let Some(explanation) = key.miswired(parts).await {
        return Derived::Miswired { explanation };
    }
    let Some(key) = key.lock_key(parts).await else {
        return Derived::NoKey;
    };
    if held_by_an_outer_layer(parts, &key, config.mode.mode(), &config.locks) {
        return Derived::Miswired {
            explanation: NESTED.to_owned(),
        };
    }
    match config.mode.take(&config.locks, &key, config.wait).await {
        Ok(handle) => Derived::Acquired {
            handle: Held::One(handle),
        },
        Err(error) => Derived::Refused { error },
    }
}
