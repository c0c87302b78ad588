//! One watch stream per backend, shared by everything that needs to hear of a change: the
//! queue places of this process's waiters (woken when the key just ahead of theirs in line is
//! deleted) and held keys (ended when someone else deletes or overwrites them).
//!
//! Each interest is one watch of one key on the stream, created with a watch id of our choosing
//! (so the answers need no matching by order) from a revision it already knows: a waiter's
//! from the one after the latest it saw, a hold's from its holder's own write of the key (see
//! `held` for why not the one after). Events since are replayed by etcd, so registering late
//! misses nothing. The stream is opened while there is at least one interest and closed when
//! there is none. When it breaks (a member died, lost its leader — requests carry etcd's
//! "require leader" flag — or stopped answering), it is opened again after a backoff
//! ([`FIRST_DELAY`] doubling to [`MOST_DELAY`], with jitter), on whichever member the backend's
//! gates let through; every waiter is woken once (its attempt finds out what it missed), and
//! every watch is created again from where it was. A watch the server cancels (its history
//! was compacted away, or it was refused) is created again after a backoff of its own, and a
//! hold whose watch was cancelled has its key read. Every send on the stream is bounded by the
//! request timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{WatchFilterType, WatchOptions, WatchResponse, WatchStream};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::errors::classify;
use super::held::HeldKey;
use super::members::Members;
use crate::backoff::Backoff;

/// The first pause before the stream is opened again after it broke, or a cancelled watch is
/// created again.
const FIRST_DELAY: Duration = Duration::from_millis(50);
/// The longest such pause.
const MOST_DELAY: Duration = Duration::from_secs(2);

/// What an interest does when its watch reports an event.
#[derive(Clone)]
pub(super) enum Sink {
    /// Wakes a waiter when the key (the one ahead of its place) is deleted.
    Wake(Arc<watch::Sender<()>>),
    /// Ends a hold on any change of its key not made by its holder (see `held`).
    End(Arc<HeldKey>),
}

/// What one interest watches: one key, from a revision on.
pub(super) struct Interest {
    pub(super) key: Vec<u8>,
    /// The first revision to report.
    pub(super) from_revision: i64,
    pub(super) sink: Sink,
}

pub(super) struct WatchHub {
    shared: Arc<HubState>,
}

struct HubState {
    members: Arc<Members>,
    interests: Mutex<Interests>,
    changed: Notify,
    stop: CancellationToken,
}

#[derive(Default)]
struct Interests {
    by_id: HashMap<i64, Watched>,
    /// Ids removed whose watch may still exist on the stream.
    cancelled: Vec<i64>,
    next_id: i64,
    running: bool,
}

struct Watched {
    interest: Interest,
    /// Sent on the current stream.
    created: bool,
    /// Not to be created again before this (the server cancelled it).
    not_before: Option<Instant>,
    /// The backoff of its re-creations, once the server cancelled it.
    recreate: Option<Backoff>,
}

impl WatchHub {
    pub(super) fn new(members: Arc<Members>) -> Self {
        WatchHub {
            shared: Arc::new(HubState {
                members,
                interests: Mutex::new(Interests::default()),
                changed: Notify::new(),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Starts watching for `interest`; returns its id for [`remove`](Self::remove). Nothing is
    /// watched once the hub has stopped.
    pub(super) fn add(&self, interest: Interest) -> i64 {
        let mut interests = self.shared.interests();
        interests.next_id = interests.next_id.saturating_add(1);
        let id = interests.next_id;
        interests.by_id.insert(
            id,
            Watched {
                interest,
                created: false,
                not_before: None,
                recreate: None,
            },
        );
        if !interests.running && !self.shared.stop.is_cancelled() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                interests.running = true;
                runtime.spawn(run(self.shared.clone()));
            }
        }
        drop(interests);
        self.shared.changed.notify_one();
        id
    }

    /// Stops watching for the interest `id`.
    pub(super) fn remove(&self, id: i64) {
        let mut interests = self.shared.interests();
        if interests.by_id.remove(&id).is_some_and(|w| w.created) {
            interests.cancelled.push(id);
        }
        drop(interests);
        self.shared.changed.notify_one();
    }

    /// Interests watched now (for tests of the watch economy).
    pub(super) fn watched(&self) -> usize {
        self.shared.interests().by_id.len()
    }

    /// Ends the stream's task for good: for a backend that shuts down.
    pub(super) fn stop(&self) {
        self.shared.stop.cancel();
    }
}

impl Drop for WatchHub {
    fn drop(&mut self) {
        self.shared.stop.cancel();
    }
}

impl HubState {
    fn interests(&self) -> MutexGuard<'_, Interests> {
        // Every critical section leaves the map consistent.
        self.interests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes every waiter once: after the stream broke, they may have missed an event.
    fn wake_all(&self) {
        for watched in self.interests().by_id.values() {
            if let Sink::Wake(wake) = &watched.interest.sink {
                wake.send_replace(());
            }
        }
    }
}

/// The stream's task: open while anyone is interested, again after it breaks.
async fn run(shared: Arc<HubState>) {
    let mut backoff = Backoff::new(FIRST_DELAY, MOST_DELAY);
    loop {
        let empty = shared.interests().by_id.is_empty();
        if empty {
            tokio::select! {
                _ = shared.stop.cancelled() => break,
                _ = shared.changed.notified() => continue,
            }
        }
        match serve(&shared).await {
            Served::Stopped => break,
            Served::Idle => backoff.reset(),
            Served::Broke { delivered } => {
                if delivered {
                    backoff.reset();
                }
                shared.wake_all();
                tokio::select! {
                    _ = shared.stop.cancelled() => break,
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                }
            }
        }
    }
    shared.interests().running = false;
}

enum Served {
    Stopped,
    /// Nobody is interested any more; the stream was closed.
    Idle,
    /// The stream failed; `delivered` if it had answered anything first.
    Broke {
        delivered: bool,
    },
}

/// One stream's life: creates every interest's watch on it, delivers events, cancels watches
/// nobody wants.
async fn serve(shared: &HubState) -> Served {
    {
        let mut interests = shared.interests();
        for watched in interests.by_id.values_mut() {
            watched.created = false;
        }
        interests.cancelled.clear();
    }
    let timeout = shared.members.timeout();
    let mut stream = tokio::select! {
        _ = shared.stop.cancelled() => return Served::Stopped,
        opened = open(shared) => match opened {
            Some(stream) => stream,
            None => return Served::Broke { delivered: false },
        },
    };
    let mut delivered = false;
    loop {
        let next_due = match sync_watches(shared, &mut stream, timeout).await {
            Some(next_due) => next_due,
            None => return Served::Broke { delivered },
        };
        if shared.interests().by_id.is_empty() {
            return Served::Idle;
        }
        let due = async {
            match next_due {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = shared.stop.cancelled() => return Served::Stopped,
            _ = shared.changed.notified() => {}
            _ = due => {}
            message = stream.message() => match message {
                Ok(Some(response)) => {
                    delivered = true;
                    if let Some(held) = deliver(shared, response) {
                        tokio::spawn(check(held, shared.members.clone()));
                    }
                }
                Ok(None) | Err(_) => return Served::Broke { delivered },
            },
        }
    }
}

/// Opens the stream with the first interest due, on a member the gates let through.
async fn open(shared: &HubState) -> Option<WatchStream> {
    let (id, (key, options)) = next_to_create(shared, Instant::now())?;
    let lent = shared.members.lend().await.ok()?;
    let mut watches = lent.client.watch_client();
    let opened = tokio::time::timeout(
        shared.members.timeout(),
        watches.watch(key, Some(options.with_watch_id(id))),
    )
    .await;
    match opened {
        Ok(Ok(stream)) => {
            lent.answered();
            Some(stream)
        }
        Ok(Err(error)) => {
            let failure = classify("watch", lent.endpoint(), error);
            lent.failed(&failure);
            None
        }
        Err(_) => {
            let failure = super::errors::Failure::timed_out(
                "watch",
                lent.endpoint(),
                shared.members.timeout(),
            );
            lent.failed(&failure);
            None
        }
    }
}

/// The next interest due to be created on the stream, marked created, as a watch request.
fn next_to_create(shared: &HubState, now: Instant) -> Option<(i64, (Vec<u8>, WatchOptions))> {
    let mut interests = shared.interests();
    let (id, watched) = interests
        .by_id
        .iter_mut()
        .find(|(_, w)| !w.created && w.not_before.is_none_or(|at| at <= now))?;
    watched.created = true;
    let interest = &watched.interest;
    let mut options = WatchOptions::new().with_start_revision(interest.from_revision);
    if matches!(interest.sink, Sink::Wake(_)) {
        // A waiter cares only that the key ahead of it went away.
        options = options.with_filters([WatchFilterType::NoPut]);
    }
    Some((*id, (interest.key.clone(), options)))
}

/// Sends the creates and cancels the stream owes, each within `timeout`. `None` if the stream
/// is gone; otherwise when the next cancelled watch is due to be created again, if any.
async fn sync_watches(
    shared: &HubState,
    stream: &mut WatchStream,
    timeout: Duration,
) -> Option<Option<Instant>> {
    let now = Instant::now();
    while let Some((id, (key, options))) = next_to_create(shared, now) {
        let sent =
            tokio::time::timeout(timeout, stream.watch(key, Some(options.with_watch_id(id))));
        if !matches!(sent.await, Ok(Ok(()))) {
            return None;
        }
    }
    let cancelled = std::mem::take(&mut shared.interests().cancelled);
    for id in cancelled {
        if !matches!(
            tokio::time::timeout(timeout, stream.cancel(id)).await,
            Ok(Ok(()))
        ) {
            return None;
        }
    }
    let next_due = shared
        .interests()
        .by_id
        .values()
        .filter(|w| !w.created)
        .filter_map(|w| w.not_before)
        .min();
    Some(next_due)
}

/// Hands one response's events to the interest it is for; a held key whose watch etcd
/// cancelled is returned, to be read directly.
fn deliver(shared: &HubState, response: WatchResponse) -> Option<Arc<HeldKey>> {
    let mut interests = shared.interests();
    let id = response.watch_id();
    let watched = interests.by_id.get_mut(&id)?;
    if response.canceled() {
        return cancelled(watched, response.compact_revision());
    }
    let interest = &mut watched.interest;
    for event in response.events() {
        let Some(kv) = event.kv() else { continue };
        match &interest.sink {
            // A deleted key comes with version 0 (read instead of the event type, whose
            // accessor panics on a type it does not know); waiters filter puts out at the
            // server.
            Sink::Wake(wake) => {
                interest.from_revision = interest
                    .from_revision
                    .max(kv.mod_revision().saturating_add(1));
                if kv.version() == 0 {
                    wake.send_replace(());
                }
            }
            // A hold's watch keeps starting at its holder's write: an event ends it or is
            // that write (see `held`).
            Sink::End(held) => held.changed_at(kv.mod_revision()),
        }
    }
    None
}

/// The server cancelled a watch: compacted past where we asked to start (or refused it). It is
/// created again after its backoff, from what is left of the history. A waiter looks for itself
/// at once; a hold is doubted and its key returned to be read, since a change in the lost
/// stretch of history would otherwise go unseen.
fn cancelled(watched: &mut Watched, compact_revision: i64) -> Option<Arc<HeldKey>> {
    watched.created = false;
    watched.interest.from_revision = watched.interest.from_revision.max(compact_revision);
    let delay = watched
        .recreate
        .get_or_insert_with(|| Backoff::new(FIRST_DELAY, MOST_DELAY))
        .next_delay();
    watched.not_before = Some(crate::clock::in_(delay));
    match &watched.interest.sink {
        Sink::Wake(wake) => {
            wake.send_replace(());
            None
        }
        Sink::End(held) => {
            held.doubt();
            Some(held.clone())
        }
    }
}

/// Reads a doubted hold's key now; a read that fails leaves the doubt to the hold's next
/// renewal (see `held`).
async fn check(held: Arc<HeldKey>, members: Arc<Members>) {
    if let Err(error) = held.check(&members).await {
        tracing::debug!(target: "lockingkit", %error, "the held etcd key could not be read after its watch was cancelled; the next renewal reads it");
    }
}
