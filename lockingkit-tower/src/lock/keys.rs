//! How a request names several locks to hold together, and the per-request work that derives
//! the keys and takes them all.

use std::future::{ready, Future};
use std::sync::Arc;

use http::request::Parts;
use lockingkit::{DistributedLock, LockMode};

use super::held::Held;
use super::key::{AcquireForRequest, Acquisition, Derived};
use super::layer::LockConfig;
use super::mode::same_namespace;
use super::{RequestLock, RequestLocks};

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

/// A [`LockKeys`] as the layer's per-request work (a separate type, so that it cannot be
/// confused with a single [`LockKey`](crate::LockKey)).
pub(crate) struct AllKeys<K>(pub(crate) K);

impl<K: LockKeys> AcquireForRequest for AllKeys<K> {
    fn acquire_for(self: Arc<Self>, mut parts: Parts, config: Arc<LockConfig>) -> Acquisition {
        Box::pin(async move {
            let derived = derive_and_acquire_all(&self.0, &mut parts, &config).await;
            (parts, derived)
        })
    }
}

async fn derive_and_acquire_all<K: LockKeys>(
    keys: &K,
    parts: &mut Parts,
    config: &LockConfig,
) -> Derived {
    if !keys.applies_to(parts).await {
        return Derived::NotApplicable;
    }
    if let Some(explanation) = keys.miswired(parts).await {
        return Derived::Miswired { explanation };
    }
    let Some(keys) = keys.lock_keys(parts).await.filter(|keys| !keys.is_empty()) else {
        return Derived::NoKey;
    };
    let mode = config.mode.mode();
    if keys
        .iter()
        .any(|key| held_by_an_outer_layer(parts, key, mode, &config.locks))
    {
        return Derived::Miswired {
            explanation: NESTED.to_owned(),
        };
    }
    let taken = match config.wait {
        None => config.locks.try_acquire_all_in(&keys, mode).await,
        Some(timeout) => config.locks.acquire_all_in(&keys, mode, timeout).await,
    };
    match taken {
        Ok(handle) => Derived::Acquired {
            handle: Held::Many(handle),
        },
        Err(error) => Derived::Refused { error },
    }
}

/// Why two layers locking one key on one request are refused.
pub(crate) const NESTED: &str = "two lock layers of one provider lock the same key on this \
     request, and locks are not reentrant (with axum, each Router::route_layer wraps every \
     route added before it)";

/// Whether a layer outside this one already holds `key` of `locks`, in the namespace of
/// `mode`, for this request: locks are not reentrant, so taking it again would be refused as
/// busy on every request.
pub(crate) fn held_by_an_outer_layer(
    parts: &Parts,
    key: &str,
    mode: LockMode,
    locks: &DistributedLock,
) -> bool {
    let one = parts.extensions.get::<RequestLock>().is_some_and(|outer| {
        outer.key() == key && same_namespace(outer.mode(), mode) && outer.is_from(locks)
    });
    let many = parts.extensions.get::<RequestLocks>().is_some_and(|outer| {
        outer.keys().any(|held| held == key)
            && same_namespace(outer.mode(), mode)
            && outer.is_from(locks)
    });
    one || many
}

impl crate::LockLayer {
    /// A layer that locks every key `keys` derives from each request's head, together, on
    /// `locks` — for a route that touches several resources, such as a transfer between two
    /// accounts.
    ///
    /// The keys are held as one (see
    /// [`DistributedLock::acquire_all`](lockingkit::DistributedLock::acquire_all)): taken in
    /// their canonical order, so requests that name them in opposite orders never deadlock, and
    /// all or nothing. Everything else is as for a single key: one attempt per request unless
    /// [`wait`](Self::wait) (one timeout for all the keys), `409` while any key is busy, `503`
    /// when the backend is unavailable, the handler dropped and `500` with `locking.lost` if
    /// any key is lost mid-request, every key released when the response is produced. The
    /// handler finds a [`RequestLocks`](crate::RequestLocks) in the request extensions.
    ///
    /// ```
    /// use http::{request::Parts, Request, Response};
    /// use lockingkit::DistributedLock;
    /// use lockingkit_tower::{LockLayer, RequestLocks};
    /// use tower::{service_fn, ServiceBuilder, ServiceExt};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// // "/transfers/7/3" locks "accounts/7" and "accounts/3".
    /// let accounts = |parts: &Parts| {
    ///     let mut ids = parts.uri.path().strip_prefix("/transfers/")?.split('/');
    ///     let (from, to) = (ids.next()?, ids.next()?);
    ///     Some(vec![format!("accounts/{from}"), format!("accounts/{to}")])
    /// };
    /// let service = ServiceBuilder::new()
    ///     .layer(LockLayer::all(DistributedLock::in_memory(), accounts))
    ///     .service(service_fn(|request: Request<String>| async move {
    ///         let locks = request.extensions().get::<RequestLocks>().cloned();
    ///         let held = locks.map_or(0, |locks| locks.members().len());
    ///         Ok::<_, std::convert::Infallible>(Response::new(format!("{held} accounts")))
    ///     }));
    /// let request = Request::builder().uri("/transfers/7/3").body(String::new())?;
    /// assert_eq!(service.oneshot(request).await?.status(), 200);
    /// # Ok(()) }
    /// ```
    pub fn all<F>(locks: DistributedLock, keys: F) -> Self
    where
        F: Fn(&Parts) -> Option<Vec<String>> + Send + Sync + 'static,
    {
        Self::with_keys(locks, keys)
    }

    /// A layer that locks the keys a custom [`LockKeys`] derives from each request, together
    /// (see [`all`](Self::all)).
    pub fn with_keys(locks: DistributedLock, keys: impl LockKeys) -> Self {
        Self::deriving(locks, Arc::new(AllKeys(keys)))
    }
}
