//! The unconfirmed-unlock protocol: what an attempt or unlock that went unanswered may have
//! left held is unlocked, retried until the server answers, and meanwhile the session takes
//! no new locks.

use std::sync::Arc;
use std::time::Duration;

use super::deadline::Elapsed;
use super::holds::{Advisory, Attempt, Object};
use super::statements::Prepared;
use super::Session;

impl Session {
    /// An attempt did not end cleanly: the session may hold what it asked for. See
    /// [`unconfirmed`](Self::unconfirmed).
    pub(in crate::providers::postgres) fn attempt_unconfirmed(
        self: &Arc<Self>,
        attempt: Attempt,
        timeout: Duration,
        answered: bool,
    ) {
        self.update(attempt.object(), |entry| {
            entry.attempting = entry.attempting.saturating_sub(1);
            entry.unconfirmed = entry.unconfirmed.saturating_add(1);
        });
        self.unconfirmed(attempt.object(), timeout, answered);
    }

    /// The unlock of `hold` did not end cleanly (or its lease was dropped unreleased): the
    /// session may still hold it. See [`unconfirmed`](Self::unconfirmed).
    pub(in crate::providers::postgres) fn release_unconfirmed(
        self: &Arc<Self>,
        hold: Advisory,
        timeout: Duration,
        answered: bool,
    ) {
        self.update(hold.object(), |entry| {
            entry.held = entry.held.saturating_sub(1);
            entry.unconfirmed = entry.unconfirmed.saturating_add(1);
        });
        self.unconfirmed(hold.object(), timeout, answered);
    }

    /// `object` may be held with no lease for it. The session takes no new locks until an
    /// unlock of it is answered, which is retried until it is.
    ///
    /// `answered` says the server answered (with an error): the session works, so the unlock
    /// follows at once. Otherwise (no answer in time, or the caller went away) the session is
    /// suspect: unless other locks depend on it, it closes, which frees the object at once.
    fn unconfirmed(self: &Arc<Self>, object: Object, timeout: Duration, answered: bool) {
        if !answered && self.held() == 0 {
            self.close();
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(resolve(self.clone(), object, timeout));
            }
            // No runtime drives the connection either; it ends with the runtime.
            Err(_) => self.close(),
        }
    }

    /// What the unlock of an unconfirmed `object` must do now.
    fn resolution(&self, object: Object) -> Resolution {
        let keys = self.keys();
        let Some(entry) = keys.by_object.get(&object).copied() else {
            return Resolution::Done;
        };
        match object {
            _ if entry.unconfirmed == 0 => Resolution::Done,
            Object::Key(_) if entry.shared && (entry.held > 0 || entry.attempting > 0) => {
                Resolution::Wait
            }
            Object::Key(key) if entry.shared => Resolution::SharedUntilFalse(key),
            Object::Key(key) => Resolution::Once(Advisory::Exclusive(key)),
            Object::Slot(semaphore, slot) => Resolution::Once(Advisory::Slot(semaphore, slot)),
            Object::Semaphore(semaphore) => Resolution::StraySlots(semaphore),
        }
    }

    /// The unconfirmed outcomes of `object` are settled: the session does not hold it.
    fn resolved(&self, object: Object, all: bool) {
        self.update(object, |entry| {
            entry.unconfirmed = if all {
                0
            } else {
                entry.unconfirmed.saturating_sub(1)
            };
        });
    }
}

/// How an unconfirmed object is settled.
#[derive(Clone, Copy, Debug)]
enum Resolution {
    /// Settled already (by another task, or the session closed).
    Done,
    /// Leases still hold the key shared on this session: a shared unlock now would take one of
    /// their holds away. Wait for them.
    Wait,
    /// One unlock; either answer settles it.
    Once(Advisory),
    /// Shared unlocks until the server says the session holds the key no more: it counts shared
    /// holds, and it is unknown how many went unanswered.
    SharedUntilFalse(i64),
    /// Unlocks every slot of the semaphore the session holds that no lease knows of: an
    /// unanswered attempt may have taken any one of them.
    StraySlots(i32),
}

impl Resolution {
    /// Sends the unlock; `true` when another is needed. Each unlocks only what `pg_locks`
    /// shows the session holding: the outcome that went unanswered may have left nothing held,
    /// and an unlock of a lock not held writes a WARNING into the server's log.
    async fn unlock(self, session: &Session) -> Result<bool, tokio_postgres::Error> {
        let client = &session.client;
        match self {
            Resolution::Done | Resolution::Wait => Ok(false),
            Resolution::Once(Advisory::Exclusive(key) | Advisory::Shared(key)) => {
                let statement = session
                    .statement(Prepared::UnlockIfHeld, super::super::UNLOCK_IF_HELD)
                    .await?;
                client.query(&statement, &[&key]).await.map(|_| false)
            }
            Resolution::Once(Advisory::Slot(semaphore, slot)) => {
                let statement = session
                    .statement(
                        Prepared::UnlockSlotIfHeld,
                        super::super::UNLOCK_SLOT_IF_HELD,
                    )
                    .await?;
                client
                    .query(&statement, &[&semaphore, &slot])
                    .await
                    .map(|_| false)
            }
            Resolution::SharedUntilFalse(key) => {
                let statement = session
                    .statement(
                        Prepared::UnlockSharedIfHeld,
                        super::super::UNLOCK_SHARED_IF_HELD,
                    )
                    .await?;
                // One row: a shared hold was given up, and there may be more.
                let rows = client.query(&statement, &[&key]).await?;
                Ok(!rows.is_empty())
            }
            Resolution::StraySlots(semaphore) => {
                let statement = session
                    .statement(Prepared::UnlockStraySlots, super::super::UNLOCK_STRAY_SLOTS)
                    .await?;
                let known = session.slots_of(semaphore);
                client
                    .query(&statement, &[&semaphore, &known])
                    .await
                    .map(|_| false)
            }
        }
    }
}

/// Retries the unlock of an unconfirmed `object` until the server answers it. An answer means
/// the session no longer holds it: statements on one session run in the order sent, so this
/// unlock runs after the attempt or unlock that went unanswered.
///
/// A session that leaves [`UNANSWERED_UNLOCKS`] retries in a row unanswered is broken, whatever
/// else depends on it: it closes, which frees every lock it holds (and is loss for them). The
/// session's checks would find the same, but only while some lock keeps checking it.
async fn resolve(session: Arc<Session>, object: Object, timeout: Duration) {
    let mut delay = Duration::from_millis(50);
    let mut unanswered = 0;
    loop {
        if session.is_closed() {
            return;
        }
        let resolution = session.resolution(object);
        match resolution {
            Resolution::Done => return,
            Resolution::Wait => {}
            _ => match session.bounded(timeout, resolution.unlock(&session)).await {
                Ok(Ok(true)) => continue,
                Ok(Ok(false)) => {
                    session.resolved(
                        object,
                        matches!(resolution, Resolution::SharedUntilFalse(_)),
                    );
                    return;
                }
                Ok(Err(error)) if error.is_closed() => return,
                // The server answered, with an error: try again.
                Ok(Err(_)) => unanswered = 0,
                Err(Elapsed) => {
                    unanswered += 1;
                    if unanswered >= UNANSWERED_UNLOCKS {
                        session.close();
                        return;
                    }
                }
            },
        }
        tokio::select! {
            _ = session.ended.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = delay
            .saturating_mul(2)
            .min(timeout.max(Duration::from_millis(50)));
    }
}

/// Unanswered unlock retries after which a session is closed as broken.
const UNANSWERED_UNLOCKS: u32 = 5;
