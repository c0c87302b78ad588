//! Queue places: first come, first served across processes.
//!
//! A writer of this process that goes on waiting after a busy answer gets a *place*: a key of
//! its own under the lock's `w/` directory, whose create revision is its place in line. The
//! lock goes to the oldest key of the directory, so a newcomer anywhere, whose first attempt
//! creates its key only in an empty directory, never overtakes it. The place is made when the
//! engine first polls the waiter's release hint (only after a busy answer, so an attempt that
//! wins costs nothing), and the one watch stream then wakes the waiter whenever a key of the
//! lock is deleted; the waiter's next attempt reads whether its place is now the oldest.
//!
//! The engine makes one hint per attempt round, and only for the front local waiter of a key,
//! so a key has at most one place per process. A place outlives one round by [`GRACE`]: when no
//! hint for the key is left after that, the wait ended (it won, timed out or was dropped) and
//! the place is deleted, which in turn wakes the waiters behind it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::PutOptions;
use tokio::sync::watch;

use super::errors::bounded;
use super::layout::{range_end, Directory};
use super::lease::LeaseGeneration;
use super::watch::{Interest, Sink};
use super::Inner;

/// How long a place outlives the last hint for its key: the engine makes a new hint before
/// each attempt, so between two rounds of one wait there is briefly none.
const GRACE: Duration = Duration::from_millis(100);

/// The places of one backend, by LockingKit key.
#[derive(Default)]
pub(super) struct Queue {
    places: Mutex<HashMap<String, PlaceState>>,
    next_id: std::sync::atomic::AtomicU64,
}

struct PlaceState {
    /// Tells a place made for this wait from one made for a later wait of the same key.
    id: u64,
    /// Wakes the key's waiter; its receivers are the live hints.
    wake: Arc<watch::Sender<()>>,
    /// A writer's attempt answered busy: the wait wants a place.
    writer_waits: bool,
    entry: Entry,
    /// An attempt is reading the place now: it must not be deleted under it.
    attempting: bool,
}

enum Entry {
    Absent,
    Creating,
    Ready(Place),
}

/// A place in line: the waiter's key and its create revision.
#[derive(Clone)]
pub(super) struct Place {
    pub(super) key: Vec<u8>,
    pub(super) revision: i64,
    generation: Arc<LeaseGeneration>,
    watch: i64,
}

/// What a queued attempt found.
pub(super) enum Turn {
    /// The place is the oldest key and no reader holds: it is the hold now.
    Held,
    Waiting,
    /// The place's key is gone (its lease expired): the wait makes a new one.
    PlaceGone,
}

impl Queue {
    fn places(&self) -> MutexGuard<'_, HashMap<String, PlaceState>> {
        // Every critical section leaves the map consistent.
        self.places.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A writer's attempt on `key` answered busy: if it waits, it wants a place.
    pub(super) fn writer_busy(&self, key: &str) {
        if let Some(place) = self.places().get_mut(key) {
            place.writer_waits = true;
        }
    }

    /// The place of `key`'s waiter on the lease `generation`, for an attempt to read; `None`
    /// if it has none ready.
    pub(super) fn claim(&self, key: &str, generation: &LeaseGeneration) -> Option<Place> {
        let mut places = self.places();
        let state = places.get_mut(key)?;
        match &state.entry {
            Entry::Ready(place) if place.generation.id == generation.id => {
                state.attempting = true;
                Some(place.clone())
            }
            // The lease it was on is gone, and the place with it.
            Entry::Ready(_) => {
                state.entry = Entry::Absent;
                None
            }
            Entry::Absent | Entry::Creating => None,
        }
    }

    pub(super) fn watched_places(&self) -> usize {
        self.places()
            .values()
            .filter(|p| matches!(p.entry, Entry::Ready(_)))
            .count()
    }
}

impl Inner {
    /// The release hint of `key` (see the module documentation).
    pub(super) fn hint(self: &Arc<Self>, key: &str) -> impl Future<Output = ()> + Send + 'static {
        let mut receiver = {
            let mut places = self.queue.places();
            let id = self
                .queue
                .next_id
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            places
                .entry(key.to_owned())
                .or_insert_with(|| PlaceState {
                    id,
                    wake: Arc::new(watch::channel(()).0),
                    writer_waits: false,
                    entry: Entry::Absent,
                    attempting: false,
                })
                .wake
                .subscribe()
        };
        let guard = HintGuard {
            backend: self.clone(),
            key: key.to_owned(),
        };
        async move {
            guard.backend.ensure_place(&guard.key);
            if receiver.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
            drop(guard);
        }
    }

    /// Starts making a place for `key` if its writer waits and has none.
    fn ensure_place(self: &Arc<Self>, key: &str) {
        let mut places = self.queue.places();
        let Some(state) = places.get_mut(key) else {
            return;
        };
        if !state.writer_waits || !matches!(state.entry, Entry::Absent) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        state.entry = Entry::Creating;
        runtime.spawn(self.clone().make_place(key.to_owned(), state.id));
    }

    /// Writes the place's key and watches its lock; wakes the waiter once it stands in line,
    /// so its next attempt reads whether it is already first.
    async fn make_place(self: Arc<Self>, key: String, id: u64) {
        let directory = Directory::lock(&self.key_prefix, &key);
        let made = self.write_place(&directory).await;
        let orphan = self.stand_in_line(&key, id, &directory, made);
        if let Some((entry, generation)) = orphan {
            // The wait ended while the place was being made.
            if let Ok(client) = self.client().await {
                self.delete_or_keep_trying(&client, entry, &generation)
                    .await;
            }
        }
    }

    /// Records a written place (watching its lock) if its wait goes on; returns it to be
    /// deleted if the wait ended meanwhile.
    fn stand_in_line(
        &self,
        key: &str,
        id: u64,
        directory: &Directory,
        made: Option<(Vec<u8>, i64, Arc<LeaseGeneration>)>,
    ) -> Option<(Vec<u8>, Arc<LeaseGeneration>)> {
        let mut places = self.queue.places();
        let state = places.get_mut(key).filter(|s| s.id == id);
        match (made, state) {
            (Some((entry, revision, generation)), Some(state)) => {
                let interest = Interest {
                    key: directory.all.clone(),
                    range_end: range_end(&directory.all),
                    from_revision: revision.saturating_add(1),
                    sink: Sink::Wake(state.wake.clone()),
                };
                let watch = match self.client.get() {
                    Some(client) => self.watches.add(client, interest),
                    None => 0,
                };
                state.entry = Entry::Ready(Place {
                    key: entry,
                    revision,
                    generation,
                    watch,
                });
                state.wake.send_replace(());
                None
            }
            (Some((entry, _, generation)), None) => Some((entry, generation)),
            (None, Some(state)) => {
                state.entry = Entry::Absent;
                // Polling takes over until the next round tries again.
                state.wake.send_replace(());
                None
            }
            (None, None) => None,
        }
    }

    /// The place's key, its create revision and its lease; `None` if it could not be written.
    async fn write_place(
        self: &Arc<Self>,
        directory: &Directory,
    ) -> Option<(Vec<u8>, i64, Arc<LeaseGeneration>)> {
        let client = self.client().await.ok()?;
        let generation = self.lease.fresh(&client).await.ok()?;
        let entry = Directory::entry(&directory.writers, &generation.next_entry_id());
        let put = || {
            let (mut kv, entry, lease) = (client.kv_client(), entry.clone(), generation.id);
            async move {
                kv.put(entry, Vec::new(), Some(PutOptions::new().with_lease(lease)))
                    .await
            }
        };
        match bounded("queue place", self.timeout, put).await {
            Ok(answer) => {
                let revision = answer.header().map(|h| h.revision())?;
                Some((entry, revision, generation))
            }
            Err(error) => {
                if error.kind() == crate::backend::BackendErrorKind::LeaseGone {
                    generation.mark_gone();
                } else if !error.reached() {
                    // It may have been written all the same; nobody else would delete it.
                    self.strays.add(self, entry, generation);
                }
                None
            }
        }
    }

    /// Ends a queued attempt: a place that became the hold, or whose key is gone, leaves the
    /// queue (its watch goes; a hold watches its own key).
    pub(super) fn settle_place(self: &Arc<Self>, key: &str, turn: Option<&Turn>) {
        let mut places = self.queue.places();
        let Some(state) = places.get_mut(key) else {
            return;
        };
        state.attempting = false;
        if matches!(turn, Some(Turn::Held | Turn::PlaceGone)) {
            if let Entry::Ready(place) = std::mem::replace(&mut state.entry, Entry::Absent) {
                self.watches.remove(place.watch);
            }
        }
        let unwanted = state.wake.receiver_count() == 0;
        drop(places);
        if unwanted {
            self.sweep_later(key.to_owned());
        }
    }

    /// Removes `key`'s place after [`GRACE`] unless a hint for it is back by then.
    fn sweep_later(self: &Arc<Self>, key: String) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let backend = Arc::downgrade(self);
        runtime.spawn(async move {
            tokio::time::sleep(GRACE).await;
            if let Some(backend) = backend.upgrade() {
                backend.sweep(&key).await;
            }
        });
    }

    async fn sweep(self: &Arc<Self>, key: &str) {
        let place = {
            let mut places = self.queue.places();
            let unwanted = places
                .get(key)
                .is_some_and(|s| s.wake.receiver_count() == 0 && !s.attempting);
            if !unwanted {
                return;
            }
            match places.remove(key).map(|s| s.entry) {
                Some(Entry::Ready(place)) => place,
                // A place being made is deleted by its maker, which finds the wait gone.
                _ => return,
            }
        };
        self.watches.remove(place.watch);
        if let Ok(client) = self.client().await {
            self.delete_or_keep_trying(&client, place.key, &place.generation)
                .await;
        }
    }
}

/// Held by each hint: when the last one of a key goes, the key's place is swept.
struct HintGuard {
    backend: Arc<Inner>,
    key: String,
}

impl Drop for HintGuard {
    fn drop(&mut self) {
        self.backend.sweep_later(std::mem::take(&mut self.key));
    }
}
