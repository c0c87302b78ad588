//! A backend decorator whose chosen calls a test changes: delayed, gated, counted or failed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use crate::backend::{PollingWait, Wait, Woken};
use crate::LockMode;

/// One call to the wrapped backend, not sent yet: awaiting it sends it, dropping it unpolled
/// means the wrapped backend never sees the call.
pub type Call<'a, T> = Pin<Box<dyn Future<Output = Result<T, BackendError>> + Send + 'a>>;

/// What a hook makes of one call: the call itself, or a future that runs around it (or in its
/// place).
type Hook<T> = Arc<dyn for<'a> Fn(Call<'a, T>) -> Call<'a, T> + Send + Sync>;

/// A future a side hook returns ([`Intercept::lease_ended_when`]).
type Signal = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What [`Intercept::on_wait`] is told as a wait opens.
type Opened = Arc<dyn Fn(&str, LockMode) + Send + Sync>;

/// Wraps a [`LockBackend`] and lets a test change what some of its calls do, leaving every
/// other call to the wrapped backend: the one fault-injecting decorator for engine tests.
///
/// A hook gets the wrapped backend's call as a [`Call`] and returns the future the engine
/// awaits instead: it can wait before sending the call ([`on_release`](Self::on_release) with a
/// sleep is a slow network), act after its answer, count it, or answer without sending it (a
/// failure, a hang). Setting a hook for the same call again wraps the one set before, so the
/// last one set runs outermost. A hook runs when the engine first polls the call, as the body
/// of an `async fn` would.
///
/// Waits go through the hooks too: the engine's attempts while it waits are this wrapper's
/// [`try_acquire`](LockBackend::try_acquire) calls, and nothing wakes a waiter early unless
/// [`wake_waits_on`](Self::wake_waits_on) says what does. `verify`, and unless set `supports`
/// and `lease_ended`, are the wrapped backend's; `shutdown` reaches it after
/// [`on_shutdown`](Self::on_shutdown)'s hook. Clones share the wrapped backend
/// and the hooks.
///
/// ```
/// use std::time::Duration;
/// use lockingkit::testing::Intercept;
/// use lockingkit::{DistributedLock, ErrorKind, MemoryBackend, MemoryStore};
/// use lockingkit::backend::{BackendError};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // Releases take 50 ms to answer, and every attempt fails as unreachable.
/// let backend = Intercept::new(MemoryBackend::new(MemoryStore::new()))
///     .on_release(|release| {
///         Box::pin(async move {
///             tokio::time::sleep(Duration::from_millis(50)).await;
///             release.await
///         })
///     })
///     .on_try_acquire(|_attempt| {
///         Box::pin(async { Err(BackendError::unreachable("connection refused")) })
///     });
/// let locks = DistributedLock::builder(backend).build().expect("valid options");
/// let err = locks.try_acquire("jobs").await.unwrap_err();
/// assert_eq!(err.kind(), ErrorKind::Unavailable);
/// # }
/// ```
pub struct Intercept<B: LockBackend> {
    inner: Arc<B>,
    provider: Option<&'static str>,
    timing: Option<LeaseTiming>,
    writer_intent: Option<Option<Duration>>,
    watches_leases: Option<bool>,
    supports: Option<fn(LockMode) -> bool>,
    try_acquire: Hook<Option<Acquired<B::Lease>>>,
    renew: Hook<()>,
    release: Hook<()>,
    opened: Option<Opened>,
    wakes: Option<watch::Sender<()>>,
    lease_ended: Option<Arc<dyn Fn() -> Signal + Send + Sync>>,
    shutdown: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl<B: LockBackend> Clone for Intercept<B> {
    fn clone(&self) -> Self {
        Intercept {
            inner: self.inner.clone(),
            provider: self.provider,
            timing: self.timing,
            writer_intent: self.writer_intent,
            watches_leases: self.watches_leases,
            supports: self.supports,
            try_acquire: self.try_acquire.clone(),
            renew: self.renew.clone(),
            release: self.release.clone(),
            opened: self.opened.clone(),
            wakes: self.wakes.clone(),
            lease_ended: self.lease_ended.clone(),
            shutdown: self.shutdown.clone(),
        }
    }
}

/// The hook that changes nothing: the call is sent as it is.
fn unchanged<T>() -> Hook<T> {
    Arc::new(|call| call)
}

/// `hook` around what `before` already makes of a call.
fn wrapped<T: 'static>(
    before: Hook<T>,
    hook: impl for<'a> Fn(Call<'a, T>) -> Call<'a, T> + Send + Sync + 'static,
) -> Hook<T> {
    Arc::new(move |call| hook(before(call)))
}

impl<B: LockBackend> Intercept<B> {
    /// Wraps `inner`, changing nothing until a hook is set.
    pub fn new(inner: B) -> Self {
        Intercept {
            inner: Arc::new(inner),
            provider: None,
            timing: None,
            writer_intent: None,
            watches_leases: None,
            supports: None,
            try_acquire: unchanged(),
            renew: unchanged(),
            release: unchanged(),
            opened: None,
            wakes: None,
            lease_ended: None,
            shutdown: None,
        }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// Runs `hook` around every attempt ([`LockBackend::try_acquire`]), a waiter's included.
    pub fn on_try_acquire(
        mut self,
        hook: impl for<'a> Fn(Call<'a, Option<Acquired<B::Lease>>>) -> Call<'a, Option<Acquired<B::Lease>>>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        self.try_acquire = wrapped(self.try_acquire, hook);
        self
    }

    /// Runs `hook` around every renewal or check ([`LockBackend::renew`]).
    pub fn on_renew(
        mut self,
        hook: impl for<'a> Fn(Call<'a, ()>) -> Call<'a, ()> + Send + Sync + 'static,
    ) -> Self {
        self.renew = wrapped(self.renew, hook);
        self
    }

    /// Runs `hook` around every release ([`LockBackend::release`]).
    pub fn on_release(
        mut self,
        hook: impl for<'a> Fn(Call<'a, ()>) -> Call<'a, ()> + Send + Sync + 'static,
    ) -> Self {
        self.release = wrapped(self.release, hook);
        self
    }

    /// Calls `opened` with the key and mode of every wait the engine opens
    /// ([`LockBackend::wait`]), when it opens it.
    pub fn on_wait(mut self, opened: impl Fn(&str, LockMode) + Send + Sync + 'static) -> Self {
        self.opened = Some(Arc::new(opened));
        self
    }

    /// Wakes every open wait ([`Woken::Retry`]) each time a value is sent on `signal` after the
    /// wait opened, as a backend that hears of releases (LISTEN/NOTIFY, pub/sub) wakes its
    /// waiters. Backends that share one `signal` wake one another's waits.
    pub fn wake_waits_on(mut self, signal: watch::Sender<()>) -> Self {
        self.wakes = Some(signal);
        self
    }

    /// Names the provider `name` in telemetry instead of the wrapped backend's name.
    pub fn provider(mut self, name: &'static str) -> Self {
        self.provider = Some(name);
        self
    }

    /// Reports `timing` instead of the wrapped backend's lease timing.
    pub fn timing(mut self, timing: LeaseTiming) -> Self {
        self.timing = Some(timing);
        self
    }

    /// Answers [`supports`](LockBackend::supports) with `supports` instead of the wrapped
    /// backend, as a backend without readers or semaphores would.
    pub fn supporting(mut self, supports: fn(LockMode) -> bool) -> Self {
        self.supports = Some(supports);
        self
    }

    /// States `intent` as the writer's intent ([`LockBackend::writer_intent`]).
    pub fn writer_intent(mut self, intent: Option<Duration>) -> Self {
        self.writer_intent = Some(intent);
        self
    }

    /// Resolves every lease's [`lease_ended`](LockBackend::lease_ended) with a future `ended`
    /// makes, in place of the wrapped backend's, and says whether the backend watches its
    /// leases ([`watches_leases`](LockBackend::watches_leases)).
    pub fn lease_ended_when<F>(
        mut self,
        watches: bool,
        ended: impl Fn() -> F + Send + Sync + 'static,
    ) -> Self
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.watches_leases = Some(watches);
        self.lease_ended = Some(Arc::new(move || Box::pin(ended())));
        self
    }

    /// Calls `closed` when the engine shuts the backend down, before the wrapped backend's
    /// own [`shutdown`](LockBackend::shutdown).
    pub fn on_shutdown(mut self, closed: impl Fn() + Send + Sync + 'static) -> Self {
        self.shutdown = Some(Arc::new(closed));
        self
    }
}

/// The wait of an [`Intercept`]: attempts through the wrapper's hooks, woken by its signal.
struct InterceptWait<B: LockBackend> {
    polling: PollingWait<Intercept<B>>,
    wakes: Option<watch::Receiver<()>>,
}

impl<B: LockBackend> Wait for InterceptWait<B> {
    type Lease = B::Lease;

    fn try_acquire(
        &mut self,
    ) -> impl Future<Output = Result<Option<Acquired<B::Lease>>, BackendError>> + Send + 'static
    {
        self.polling.try_acquire()
    }

    async fn changed(&mut self) -> Woken<B::Lease> {
        if let Some(wakes) = &mut self.wakes {
            if wakes.changed().await.is_ok() {
                return Woken::Retry;
            }
        }
        // Without a signal (or once nobody can send on it) nothing wakes the waiter early.
        std::future::pending().await
    }
}

impl<B: LockBackend> LockBackend for Intercept<B> {
    type Lease = B::Lease;

    fn provider(&self) -> &str {
        self.provider.unwrap_or_else(|| self.inner.provider())
    }

    fn timing(&self) -> LeaseTiming {
        self.timing.unwrap_or_else(|| self.inner.timing())
    }

    fn supports(&self, mode: LockMode) -> bool {
        self.supports
            .map_or_else(|| self.inner.supports(mode), |supports| supports(mode))
    }

    fn writer_intent(&self) -> Option<Duration> {
        self.writer_intent
            .unwrap_or_else(|| self.inner.writer_intent())
    }

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<B::Lease>>, BackendError> {
        let inner = &self.inner;
        (self.try_acquire)(Box::pin(async move { inner.try_acquire(key, mode).await })).await
    }

    async fn renew(&self, lease: &B::Lease) -> Result<(), BackendError> {
        let inner = &self.inner;
        (self.renew)(Box::pin(async move { inner.renew(lease).await })).await
    }

    async fn release(&self, lease: &B::Lease) -> Result<(), BackendError> {
        let inner = &self.inner;
        (self.release)(Box::pin(async move { inner.release(lease).await })).await
    }

    fn wait(self: Arc<Self>, key: &str, mode: LockMode) -> impl Wait<Lease = B::Lease> + use<B> {
        if let Some(opened) = &self.opened {
            opened(key, mode);
        }
        // Subscribed as the wait opens: a signal sent from now on wakes it.
        let wakes = self.wakes.as_ref().map(watch::Sender::subscribe);
        InterceptWait {
            polling: PollingWait::new(self, key, mode),
            wakes,
        }
    }

    fn lease_ended(&self, lease: &B::Lease) -> impl Future<Output = ()> + Send {
        let ended = self.lease_ended.as_ref().map(|ended| ended());
        let inner = self.inner.lease_ended(lease);
        async move {
            match ended {
                Some(ended) => ended.await,
                None => inner.await,
            }
        }
    }

    fn verify(&self) -> impl Future<Output = Result<(), BackendError>> + Send {
        self.inner.verify()
    }

    fn shutdown(&self) -> impl Future<Output = ()> + Send {
        let (closed, inner) = (self.shutdown.clone(), self.inner.shutdown());
        async move {
            if let Some(closed) = closed {
                closed();
            }
            inner.await
        }
    }

    fn watches_leases(&self) -> bool {
        self.watches_leases
            .unwrap_or_else(|| self.inner.watches_leases())
    }
}
