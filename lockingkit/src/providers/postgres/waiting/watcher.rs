//! The watcher of one key: slices in the server's lock queue until it is granted the key, then
//! keeps the grant for the waiter it wakes (see the module above).

use std::sync::Arc;

use tokio_postgres::types::{ToSql, Type};

use super::slice::SLICE;
use super::{Grant, KeyWaiters, WaitingSession, WatchState};

/// Why a watcher stopped.
enum WatcherExit {
    /// Nobody waits any more, or the backend is gone; the session holds nothing and may serve
    /// another key.
    Clean(WaitingSession),
    /// A waiter claimed the grant: the session is its lease's now.
    Claimed,
    /// Nobody waits any more, but a request was still queued: the session closes.
    Done,
    /// The session could not be opened.
    ConnectFailed,
    /// The session failed, or may hold what nobody claimed: it closes.
    Failed,
}

pub(super) async fn watcher(shared: Arc<WatchState>, advisory_key: i64, key: Arc<KeyWaiters>) {
    let end = match shared.sessions.take().await {
        Some(waiting) => watch_key(&shared, waiting, &key, advisory_key).await,
        None if shared.stop.is_cancelled() => WatcherExit::Done,
        None => WatcherExit::ConnectFailed,
    };
    match end {
        WatcherExit::Clean(waiting) => shared.sessions.keep(waiting),
        WatcherExit::Claimed | WatcherExit::Done => {}
        WatcherExit::ConnectFailed | WatcherExit::Failed => {
            // The waiters may have been counting on us: let each look once, then poll.
            key.writers.send_replace(());
            key.readers.send_replace(());
        }
    }
    shared.watcher_ended(advisory_key);
}

/// Slices until the server grants the key and a waiter claims it, or nobody waits any more.
async fn watch_key(
    shared: &WatchState,
    mut waiting: WaitingSession,
    key: &KeyWaiters,
    advisory_key: i64,
) -> WatcherExit {
    loop {
        let (exclusive, fencing_token) =
            match wait_for_grant(shared, &waiting, key, advisory_key).await {
                Slices::Granted {
                    exclusive,
                    fencing_token,
                } => (exclusive, fencing_token),
                Slices::Left => return WatcherExit::Clean(waiting),
                Slices::LeftQueued => return WatcherExit::Done,
                Slices::Failed => return WatcherExit::Failed,
            };
        let grant = Grant {
            waiting,
            exclusive,
            fencing_token,
        };
        waiting = match hand_over(shared, key, advisory_key, grant).await {
            HandOver::Claimed => return WatcherExit::Claimed,
            // Waiters of the other kind may still wait: the next slice is theirs.
            HandOver::Unlocked(waiting) => waiting,
            HandOver::Failed => return WatcherExit::Failed,
        };
    }
}

/// How a run of watch statements ended.
enum Slices {
    /// The server granted the key: the session holds it, with this fencing token.
    Granted { exclusive: bool, fencing_token: i64 },
    /// Nobody waits any more; nothing is queued.
    Left,
    /// Nobody waits any more, and a statement is still queued.
    LeftQueued,
    /// The session failed, or a statement stayed unanswered well past its slice.
    Failed,
}

/// Sends watch statements, one slice after another, each queued as the waiters want it then,
/// until one is granted or nobody waits any more.
async fn wait_for_grant(
    shared: &WatchState,
    waiting: &WaitingSession,
    key: &KeyWaiters,
    advisory_key: i64,
) -> Slices {
    loop {
        let Some(exclusive) = key.wanted().await else {
            return Slices::Left;
        };
        let statement = waiting
            .slices
            .wait_one(waiting.session.client(), advisory_key, exclusive);
        let answer = tokio::select! {
            _ = shared.stop.cancelled() => return Slices::LeftQueued,
            answer = crate::background::within(SLICE + shared.timeout, statement) => answer,
            _ = key.all_left() => return Slices::LeftQueued,
        };
        match answer {
            Some(Ok(Some(fencing_token))) => {
                return Slices::Granted {
                    exclusive,
                    fencing_token,
                }
            }
            // The slice ended with the key still taken: the next one queues again.
            Some(Ok(None)) => {}
            // An error may come after the grant, and an unanswered statement may still be
            // granted: either way the session closes, which frees whatever it holds.
            Some(Err(_)) | None => return Slices::Failed,
        }
    }
}

/// How a grant ended.
enum HandOver {
    /// A waiter's attempt took it.
    Claimed,
    /// Nobody claimed it, and the server confirmed its unlock: the session is clean again.
    Unlocked(WaitingSession),
    /// Nobody claimed it, and its unlock went unanswered: the session must close.
    Failed,
}

/// Parks `grant` for the waiters of its kind and wakes them; a waiter's next attempt claims it
/// (see `Watchers::claim`). Unclaimed once they have left, or a slice after the wake-up, it
/// is unlocked: the watcher never holds a key for nobody longer than that.
async fn hand_over(
    shared: &WatchState,
    key: &KeyWaiters,
    advisory_key: i64,
    grant: Grant,
) -> HandOver {
    let exclusive = grant.exclusive;
    let claimed = key.claimed.notified();
    let mut claimed = std::pin::pin!(claimed);
    claimed.as_mut().enable();
    let waited_for = key.waiters(exclusive).receiver_count() > 0;
    *key.grant() = Some(grant);
    key.waiters(exclusive).send_replace(());
    // Nobody of its kind waits: not a moment held for nobody.
    if waited_for {
        tokio::select! {
            _ = &mut claimed => return HandOver::Claimed,
            _ = tokio::time::sleep(SLICE) => {}
            _ = key.left(exclusive) => {}
            _ = shared.stop.cancelled() => {}
        }
    }
    // Taken back under the slot's lock, so a claim at this very moment either won or never
    // sees it.
    let Some(grant) = key.grant().take() else {
        return HandOver::Claimed;
    };
    let sql = if exclusive {
        super::super::UNLOCK
    } else {
        super::super::UNLOCK_SHARED
    };
    let client = grant.waiting.session.client();
    let params: [(&(dyn ToSql + Sync), Type); 1] = [(&advisory_key, Type::INT8)];
    let unlock = client.query_typed_one(sql, &params);
    match crate::background::within(shared.timeout, unlock).await {
        Some(Ok(row)) if row.try_get::<_, bool>(0).unwrap_or(false) => {
            HandOver::Unlocked(grant.waiting)
        }
        _ => HandOver::Failed,
    }
}
