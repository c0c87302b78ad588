//! The per-request work of a layer: ask the request for its key or keys, check the wiring, take
//! the lock. One path for one key and for several keys held as one; the layer keeps it boxed,
//! so that any [`LockKey`] or [`LockKeys`] fits.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::request::Parts;
use lockingkit::LockError;

use super::handle::Handle;
use super::key::{LockKey, LockKeys};
use super::layer::LockConfig;
use super::nesting::{held_by_an_outer_layer, NESTED};

/// What deriving the key and taking the lock came to, for one request.
pub(crate) enum Derived {
    /// [`LockKey::applies_to`] said no: the request goes on unlocked.
    NotApplicable,
    /// No key could be derived.
    NoKey,
    Acquired {
        handle: Handle,
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

/// The layer's per-request work with the key source's type erased, so that the layer can hold
/// any: it boxes the whole of it (key derivation and acquisition) in one allocation.
pub(crate) trait AcquireForRequest: Send + Sync + 'static {
    /// Takes `parts` for the duration and hands them back with the outcome.
    /// The layer's `config` says on which provider, in which mode and how long to wait.
    fn acquire_for(self: Arc<Self>, parts: Parts, config: Arc<LockConfig>) -> Acquisition;
}

/// A [`LockKey`] as the layer's key source.
pub(crate) struct OneKey<K>(pub(crate) K);

/// A [`LockKeys`] as the layer's key source (a separate type, so that it cannot be confused
/// with a single [`LockKey`]).
pub(crate) struct AllKeys<K>(pub(crate) K);

/// What the request asked to lock.
enum Wanted {
    One(String),
    /// Never empty: a request that names no keys has no key.
    Many(Vec<String>),
}

/// The three questions the layer asks a request, whichever trait answers them.
trait KeySource: Send + Sync + 'static {
    fn applies_to(&self, parts: &mut Parts) -> impl Future<Output = bool> + Send;
    fn miswired(&self, parts: &mut Parts) -> impl Future<Output = Option<String>> + Send;
    fn wanted(&self, parts: &mut Parts) -> impl Future<Output = Option<Wanted>> + Send;
}

impl<K: LockKey> KeySource for OneKey<K> {
    fn applies_to(&self, parts: &mut Parts) -> impl Future<Output = bool> + Send {
        self.0.applies_to(parts)
    }

    fn miswired(&self, parts: &mut Parts) -> impl Future<Output = Option<String>> + Send {
        self.0.miswired(parts)
    }

    async fn wanted(&self, parts: &mut Parts) -> Option<Wanted> {
        self.0.lock_key(parts).await.map(Wanted::One)
    }
}

impl<K: LockKeys> KeySource for AllKeys<K> {
    fn applies_to(&self, parts: &mut Parts) -> impl Future<Output = bool> + Send {
        self.0.applies_to(parts)
    }

    fn miswired(&self, parts: &mut Parts) -> impl Future<Output = Option<String>> + Send {
        self.0.miswired(parts)
    }

    async fn wanted(&self, parts: &mut Parts) -> Option<Wanted> {
        let keys = self.0.lock_keys(parts).await?;
        (!keys.is_empty()).then_some(Wanted::Many(keys))
    }
}

impl<K: KeySource> AcquireForRequest for K {
    fn acquire_for(self: Arc<Self>, mut parts: Parts, config: Arc<LockConfig>) -> Acquisition {
        Box::pin(async move {
            let derived = derive_and_acquire(&*self, &mut parts, &config).await;
            (parts, derived)
        })
    }
}

async fn derive_and_acquire(
    source: &impl KeySource,
    parts: &mut Parts,
    config: &LockConfig,
) -> Derived {
    if !source.applies_to(parts).await {
        return Derived::NotApplicable;
    }
    if let Some(explanation) = source.miswired(parts).await {
        return Derived::Miswired { explanation };
    }
    let Some(wanted) = source.wanted(parts).await else {
        return Derived::NoKey;
    };
    let mode = config.mode.mode();
    if wanted
        .keys()
        .iter()
        .any(|key| held_by_an_outer_layer(parts, key, mode, &config.locks))
    {
        return Derived::Miswired {
            explanation: NESTED.to_owned(),
        };
    }
    match wanted.take(config).await {
        Ok(handle) => Derived::Acquired { handle },
        Err(error) => Derived::Refused { error },
    }
}

impl Wanted {
    fn keys(&self) -> &[String] {
        match self {
            Wanted::One(key) => std::slice::from_ref(key),
            Wanted::Many(keys) => keys,
        }
    }

    /// Takes the lock (or every key, as one hold) in the layer's mode: one attempt, or waiting
    /// up to the layer's timeout.
    async fn take(self, config: &LockConfig) -> Result<Handle, LockError> {
        let (locks, mode, wait) = (&config.locks, config.mode, config.wait);
        match self {
            Wanted::One(key) => mode.take(locks, &key, wait).await.map(Handle::One),
            Wanted::Many(keys) => mode.take_all(locks, &keys, wait).await.map(Handle::Many),
        }
    }
}
