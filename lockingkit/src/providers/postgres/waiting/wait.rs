//! One caller's wait on the PostgreSQL backend (see the module above): attempts that take the
//! watcher's grant or are answered by its queued request, and a wake-up when a grant comes.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch as channel;

use super::{KeyWaits, WatchState};
use crate::backend::{Acquired, BackendError, LockMode, PollingWait, Wait, Woken};
use crate::providers::postgres::keys::PostgresLockKeys;
use crate::providers::postgres::{PostgresBackend, PostgresLease};

/// The wait of one caller on a [`PostgresBackend`]. A semaphore's waits poll: its slots are
/// many keys, and no one request in the server's queue stands for all of them.
pub(in crate::providers::postgres) struct PostgresWait(Kind);

enum Kind {
    Polling(PollingWait<PostgresBackend>),
    Watched(Watched),
}

/// A wait for a plain lock, a writer's or a reader's, served by the key's watcher.
struct Watched {
    backend: Arc<PostgresBackend>,
    shared: Arc<WatchState>,
    key: Arc<KeyWaits>,
    advisory_key: i64,
    exclusive: bool,
    events: channel::Receiver<()>,
    /// Whether the wait still counts among the key's waits: until it takes a grant.
    counted: bool,
}

impl PostgresWait {
    pub(in crate::providers::postgres) fn open(
        backend: Arc<PostgresBackend>,
        key: &str,
        mode: LockMode,
    ) -> Self {
        let exclusive = match mode {
            LockMode::Exclusive => true,
            LockMode::Shared => false,
            LockMode::Semaphore { .. } => {
                return PostgresWait(Kind::Polling(PollingWait::new(backend, key, mode)))
            }
        };
        let advisory_key = PostgresLockKeys::advisory_key(key);
        let shared = backend.inner.watchers.shared.clone();
        let waits = shared.open(advisory_key, exclusive);
        let events = waits.events.subscribe();
        PostgresWait(Kind::Watched(Watched {
            backend,
            shared,
            key: waits,
            advisory_key,
            exclusive,
            events,
            counted: true,
        }))
    }
}

impl std::fmt::Debug for PostgresWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is the caller's data: never printed.
        f.debug_struct("PostgresWait").finish_non_exhaustive()
    }
}

impl Watched {
    /// The grant kept for this wait, as its lease, if there is one.
    fn claim(&mut self) -> Option<(Acquired<PostgresLease>, tokio::time::Instant)> {
        if !self.counted {
            return None;
        }
        let claimed = self
            .shared
            .claim(self.advisory_key, &self.key, self.exclusive)?;
        self.counted = false;
        let sent = claimed.sent;
        Some((self.backend.adopted_lease(self.advisory_key, claimed), sent))
    }
}

impl Wait for PostgresWait {
    type Lease = PostgresLease;

    fn try_acquire(
        &mut self,
    ) -> impl Future<Output = Result<Option<Acquired<PostgresLease>>, BackendError>> + Send + 'static
    {
        let watched = match &mut self.0 {
            Kind::Polling(polling) => return Box::pin(polling.try_acquire()) as BoxedAttempt,
            Kind::Watched(watched) => watched,
        };
        if let Some((acquired, _)) = watched.claim() {
            return Box::pin(std::future::ready(Ok(Some(acquired))));
        }
        if !watched.key.state().begin_attempt() {
            // The watcher's request stands in the server's queue for this wait: the key is
            // taken, and a request of our own beside it could be granted with it.
            return Box::pin(std::future::ready(Ok(None)));
        }
        let (backend, shared, key) = (
            watched.backend.clone(),
            watched.shared.clone(),
            watched.key.clone(),
        );
        let (advisory_key, exclusive) = (watched.advisory_key, watched.exclusive);
        let mode = if exclusive {
            LockMode::Exclusive
        } else {
            LockMode::Shared
        };
        Box::pin(async move {
            // Ends the attempt however this future ends (answered, or dropped in flight), so a
            // watcher may start again.
            let attempting = Attempting(&key);
            let taken = backend.attempt_mode(advisory_key, mode).await;
            drop(attempting);
            if let Ok(None) = taken {
                // Still busy with no watcher (the last one ended, or none could start): one
                // may start now.
                shared.start_watcher(advisory_key, &key);
            }
            taken
        })
    }

    async fn changed(&mut self) -> Woken<PostgresLease> {
        let watched = match &mut self.0 {
            Kind::Polling(_) => return std::future::pending().await,
            Kind::Watched(watched) => watched,
        };
        loop {
            if let Some((acquired, sent)) = watched.claim() {
                return Woken::Granted { acquired, sent };
            }
            if watched.events.changed().await.is_err() {
                // The backend is gone: polling takes over.
                return std::future::pending().await;
            }
            if let Some((acquired, sent)) = watched.claim() {
                return Woken::Granted { acquired, sent };
            }
            if !watched.key.state().watching {
                // The watcher ended (it failed, or was granted the key for the other kind):
                // the next attempt asks the server itself.
                return Woken::Retry;
            }
        }
    }
}

/// A wait's attempt on a lock session, in flight: no watcher starts for the key meanwhile.
struct Attempting<'a>(&'a KeyWaits);

impl Drop for Attempting<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.attempting = state.attempting.saturating_sub(1);
    }
}

type BoxedAttempt = std::pin::Pin<
    Box<dyn Future<Output = Result<Option<Acquired<PostgresLease>>, BackendError>> + Send>,
>;

impl Drop for Watched {
    fn drop(&mut self) {
        self.shared
            .close(self.advisory_key, &self.key, self.exclusive, self.counted);
    }
}
