//! The watcher of one key: slices in the server's lock queue until it is granted the key for
//! a wait, or nobody waits any more (see the module above).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::time::Instant;

use super::slice::SLICE;
use super::{unlock, Grant, KeyState, KeyWaits, Queued, WaitingSession, WatchState};

/// How a watcher ended.
enum Exit {
    /// Nobody waits any more, or the backend stopped; the session holds nothing and may serve
    /// another key.
    Clean(WaitingSession),
    /// A grant waits for its wait: the session is the grant's now.
    Granted,
    /// The session could not be opened, failed, or may hold what nobody took: it is gone.
    Failed,
}

pub(super) async fn watcher(shared: Arc<WatchState>, advisory_key: i64, key: Arc<KeyWaits>) {
    let exit = match shared.sessions.take().await {
        Some(waiting) => watch_key(&shared, waiting, &key, advisory_key).await,
        None => Exit::Failed,
    };
    {
        let mut state = key.state();
        state.watching = false;
        // A grant keeps its session busy until a wait takes it or it is unlocked.
        if !matches!(exit, Exit::Granted) {
            shared.busy.fetch_sub(1, Ordering::AcqRel);
        }
    }
    if let Exit::Clean(waiting) = exit {
        shared.sessions.keep(waiting);
    }
    // The waits look again: a grant for them, or nobody watching any more (they attempt).
    key.events.send_replace(());
    shared.forget_if_idle(advisory_key);
}

/// Slices until the server grants the key for a wait, or nobody waits any more.
async fn watch_key(
    shared: &WatchState,
    mut waiting: WaitingSession,
    key: &KeyWaits,
    advisory_key: i64,
) -> Exit {
    loop {
        let exclusive = {
            let mut state = key.state();
            let Some(exclusive) = state.wanted().filter(|_| !shared.stop.is_cancelled()) else {
                return Exit::Clean(waiting);
            };
            state.queued = Some(Queued {
                exclusive,
                process: waiting.slices.withdrawable(),
                withdrawn: false,
            });
            exclusive
        };
        let sent = Instant::now();
        let statement = waiting
            .slices
            .wait_one(waiting.session.client(), advisory_key, exclusive);
        let answer = tokio::select! {
            _ = shared.stop.cancelled() => None,
            answer = crate::background::within(SLICE + shared.timeout, statement) => answer,
        };
        let (withdrawn, next) = match answer {
            // Granted: the session holds the key now.
            Some(Ok(Some(fencing_token))) => {
                let grant = Grant {
                    waiting,
                    exclusive,
                    fencing_token,
                    sent,
                };
                match hand_over(shared, key, advisory_key, grant).await {
                    (withdrawn, Ok(waiting)) => (withdrawn, Some(waiting)),
                    (withdrawn, Err(exit)) => {
                        settle_if(withdrawn, shared, advisory_key, key);
                        return exit;
                    }
                }
            }
            // The slice ended (or was withdrawn) with the key still taken: the next one queues
            // again, as the waits want it now.
            Some(Ok(None)) => (unqueue(key), Some(waiting)),
            // An error may come after the grant, and an unanswered statement may still be
            // granted: either way the session closes, which frees whatever it holds.
            Some(Err(_)) | None => (unqueue(key), None),
        };
        settle_if(withdrawn, shared, advisory_key, key);
        match next {
            Some(clean) => waiting = clean,
            None => return Exit::Failed,
        }
    }
}

/// The watcher's request answered: it is no longer queued. Returns whether it was withdrawn.
fn unqueue(key: &KeyWaits) -> bool {
    take_queued(&mut key.state())
}

/// [`unqueue`] with the key's state already locked.
fn take_queued(state: &mut KeyState) -> bool {
    state.queued.take().is_some_and(|queued| queued.withdrawn)
}

/// A withdrawn request has answered: that clean-up of the key is done.
fn settle_if(withdrawn: bool, shared: &WatchState, advisory_key: i64, key: &KeyWaits) {
    if withdrawn {
        shared.end_settling(advisory_key, key);
    }
}

/// Parks `grant` for the waits of its kind and wakes them, or, if none is left, unlocks it at
/// once: `Ok` with the session, clean again, to go on watching. The watcher never holds a key
/// for nobody longer than that unlock. Also returns whether the request had been withdrawn.
///
/// The request stops counting as queued in the same critical section that parks the grant or
/// starts its unlock, so no moment lies between them in which a wait that ends sees neither
/// (and withdraws nothing) while the next attempt finds nothing settling and the grant answers
/// it "busy" for nobody.
async fn hand_over(
    shared: &WatchState,
    key: &KeyWaits,
    advisory_key: i64,
    grant: Grant,
) -> (bool, Result<WaitingSession, Exit>) {
    let exclusive = grant.exclusive;
    let withdrawn = {
        let mut state = key.state();
        let withdrawn = take_queued(&mut state);
        // Two grants are never parked at once (a second request queues behind the first
        // grant); were one there, the new one would be unlocked like one nobody waits for.
        if state.waits(exclusive) > 0 && state.grant.is_none() {
            state.grant = Some(grant);
            drop(state);
            key.events.send_replace(());
            return (withdrawn, Err(Exit::Granted));
        }
        // Nobody of its kind waits: an attempt of this process waits until it is unlocked.
        shared.begin_settling(&mut state);
        withdrawn
    };
    let unlocked = unlock(&grant.waiting, advisory_key, exclusive, shared.timeout).await;
    shared.end_settling(advisory_key, key);
    let session = if unlocked {
        Ok(grant.waiting)
    } else {
        Err(Exit::Failed)
    };
    (withdrawn, session)
}
