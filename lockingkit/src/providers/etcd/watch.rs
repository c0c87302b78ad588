//! One watch stream per backend, shared by everything that needs to hear of a change: the
//! queue places of this process's waiters (woken when a key of their lock is deleted) and held
//! keys (ended when someone else deletes or overwrites them).
//!
//! Each interest is one watch on the stream, created with a watch id of our choosing (so the
//! answers need no matching by order) from the revision after the one it already knows: events
//! in between are replayed by etcd, so registering late misses nothing. The stream is opened
//! while there is at least one interest and closed when there is none. When it breaks (a member
//! died, lost its leader — requests carry etcd's "require leader" flag — or stopped
//! answering), it is opened again after a backoff, one connect at a time, every waiter is woken
//! once (its attempt finds out what it missed), and every watch resumes from the revision after
//! the last event it saw.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{Client, WatchFilterType, WatchOptions, WatchResponse, WatchStream};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

/// The first pause before the stream is opened again after it broke; it doubles up to
/// [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// What an interest does when its watch reports an event.
#[derive(Clone)]
pub(super) enum Sink {
    /// Wakes a waiter (any deletion under its lock's directory).
    Wake(Arc<watch::Sender<()>>),
    /// Ends a hold (any change of its key), once. `created` is the key's create revision, to
    /// check it against after the watch's history was compacted away.
    End {
        ended: CancellationToken,
        created: i64,
    },
}

/// What one interest watches.
pub(super) struct Interest {
    pub(super) key: Vec<u8>,
    /// Empty for a single key.
    pub(super) range_end: Vec<u8>,
    /// The first revision to report.
    pub(super) from_revision: i64,
    pub(super) sink: Sink,
}

pub(super) struct WatchHub {
    shared: Arc<HubState>,
}

struct HubState {
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
}

impl WatchHub {
    pub(super) fn new() -> Self {
        WatchHub {
            shared: Arc::new(HubState {
                interests: Mutex::new(Interests::default()),
                changed: Notify::new(),
                stop: CancellationToken::new(),
            }),
        }
    }

    /// Starts watching for `interest`; returns its id for [`remove`](Self::remove).
    pub(super) fn add(&self, client: &Client, interest: Interest) -> i64 {
        let mut interests = self.shared.interests();
        interests.next_id += 1;
        let id = interests.next_id;
        interests.by_id.insert(
            id,
            Watched {
                interest,
                created: false,
            },
        );
        if !interests.running {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                interests.running = true;
                runtime.spawn(run(self.shared.clone(), client.clone()));
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
async fn run(shared: Arc<HubState>, client: Client) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let empty = shared.interests().by_id.is_empty();
        if empty {
            tokio::select! {
                _ = shared.stop.cancelled() => break,
                _ = shared.changed.notified() => continue,
            }
        }
        match serve(&shared, &client).await {
            Served::Stopped => break,
            Served::Idle => backoff = MIN_BACKOFF,
            Served::Broke { delivered } => {
                if delivered {
                    backoff = MIN_BACKOFF;
                }
                shared.wake_all();
                tokio::select! {
                    _ = shared.stop.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
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
async fn serve(shared: &HubState, client: &Client) -> Served {
    for watched in shared.interests().by_id.values_mut() {
        watched.created = false;
    }
    shared.interests().cancelled.clear();
    let Some((first_id, first)) = next_to_create(shared) else {
        return Served::Idle;
    };
    let mut watches = client.watch_client();
    let opened = tokio::select! {
        _ = shared.stop.cancelled() => return Served::Stopped,
        opened = tokio::time::timeout(MAX_BACKOFF * 5, watches.watch(first.0, Some(first.1.with_watch_id(first_id)))) => opened,
    };
    let Ok(Ok(mut stream)) = opened else {
        return Served::Broke { delivered: false };
    };
    let mut delivered = false;
    loop {
        if !sync_watches(shared, &mut stream).await {
            return Served::Broke { delivered };
        }
        if shared.interests().by_id.is_empty() {
            return Served::Idle;
        }
        tokio::select! {
            _ = shared.stop.cancelled() => return Served::Stopped,
            _ = shared.changed.notified() => {}
            message = stream.message() => match message {
                Ok(Some(response)) => {
                    delivered = true;
                    if let Some(check) = deliver(shared, response) {
                        tokio::spawn(check.run(client.clone()));
                    }
                }
                Ok(None) | Err(_) => return Served::Broke { delivered },
            },
        }
    }
}

/// The next interest not yet created on the stream, marked created, as a watch request.
fn next_to_create(shared: &HubState) -> Option<(i64, (Vec<u8>, WatchOptions))> {
    let mut interests = shared.interests();
    let (id, watched) = interests.by_id.iter_mut().find(|(_, w)| !w.created)?;
    watched.created = true;
    let interest = &watched.interest;
    let mut options = WatchOptions::new().with_start_revision(interest.from_revision);
    if !interest.range_end.is_empty() {
        options = options.with_range(interest.range_end.clone());
    }
    if matches!(interest.sink, Sink::Wake(_)) {
        // A waiter cares only that a key of its lock went away.
        options = options.with_filters([WatchFilterType::NoPut]);
    }
    Some((*id, (interest.key.clone(), options)))
}

/// Sends the creates and cancels the stream owes; false if the stream is gone.
async fn sync_watches(shared: &HubState, stream: &mut WatchStream) -> bool {
    while let Some((id, (key, options))) = next_to_create(shared) {
        if stream
            .watch(key, Some(options.with_watch_id(id)))
            .await
            .is_err()
        {
            return false;
        }
    }
    let cancelled = std::mem::take(&mut shared.interests().cancelled);
    for id in cancelled {
        if stream.cancel(id).await.is_err() {
            return false;
        }
    }
    true
}

/// Hands one response's events to the interest it is for; a held key whose watch history was
/// compacted away is returned, to be looked at directly.
fn deliver(shared: &HubState, response: WatchResponse) -> Option<HeldKeyCheck> {
    let mut interests = shared.interests();
    let id = response.watch_id();
    let watched = interests.by_id.get_mut(&id)?;
    if response.canceled() {
        // Compacted past where we asked to start (or refused): the watch resumes from what is
        // left at the next sync. A waiter looks for itself; a hold's key is read directly,
        // since a change in the lost stretch of history would otherwise go unseen.
        watched.created = false;
        if response.compact_revision() > 0 {
            watched.interest.from_revision = response.compact_revision();
        }
        return match &watched.interest.sink {
            Sink::Wake(_) => {
                fire(&watched.interest.sink);
                None
            }
            Sink::End { ended, created } => Some(HeldKeyCheck {
                key: watched.interest.key.clone(),
                created: *created,
                ended: ended.clone(),
            }),
        };
    }
    let mut fired = false;
    for event in response.events() {
        let Some(kv) = event.kv() else { continue };
        watched.interest.from_revision = watched.interest.from_revision.max(kv.mod_revision() + 1);
        // A deleted key comes with version 0 (read instead of the event type, whose accessor
        // panics on a type it does not know). Waiters filter puts out at the server; a put
        // reaching a hold is an overwrite.
        fired |= match &watched.interest.sink {
            Sink::Wake(_) => kv.version() == 0,
            Sink::End { .. } => true,
        };
    }
    if fired {
        fire(&watched.interest.sink);
    }
    None
}

/// A held key to read directly, because its watch history was compacted away.
struct HeldKeyCheck {
    key: Vec<u8>,
    created: i64,
    ended: CancellationToken,
}

impl HeldKeyCheck {
    /// Ends the hold unless the key is still the one it created. A read that fails leaves the
    /// hold to its renewals.
    async fn run(self, client: Client) {
        let mut kv = client.kv_client();
        let read = tokio::time::timeout(MAX_BACKOFF * 5, kv.get(self.key, None)).await;
        if let Ok(Ok(found)) = read {
            let same = found
                .kvs()
                .first()
                .is_some_and(|kv| kv.create_revision() == self.created);
            if !same {
                self.ended.cancel();
            }
        }
    }
}

fn fire(sink: &Sink) {
    match sink {
        Sink::Wake(wake) => {
            wake.send_replace(());
        }
        Sink::End { ended, .. } => ended.cancel(),
    }
}
