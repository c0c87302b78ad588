//! The key of one hold, as its holder wrote it, and how the hold finds out that someone else
//! deleted or changed it.
//!
//! The hold's watch starts at [`HeldKey::written`], the revision of the holder's own last
//! write of the key, not the one after it. That revision is a put, never a delete, so etcd
//! either replays the key's history from there (the holder's write first, which is skipped,
//! then every change since) or, when its history was compacted past it, cancels the watch with
//! the compaction revision. Starting one revision later would leave a hole: etcd compacting
//! exactly at a delete removes the delete's tombstone, and a watch starting at that revision is
//! not cancelled (only one starting *before* the compaction revision is), so it would never
//! report the delete.
//!
//! A watch that etcd cancelled cannot vouch for the key: the hold is *doubted* until a read of
//! the key answers (see [`HeldKey::check`]). The watch task reads it at once; a read that
//! fails is made again by the hold's next renewal, which does not vouch for a doubted hold
//! before the read has answered.

use std::sync::atomic::{AtomicU64, Ordering};

use etcd_client::GetOptions;
use tokio_util::sync::CancellationToken;

use super::members::{Members, Resend};
use crate::backend::BackendError;

/// What a hold knows of its key.
pub(super) struct HeldKey {
    pub(super) key: Vec<u8>,
    /// The key's create revision: the fencing token.
    pub(super) created: i64,
    /// The revision of the holder's last write of the key: its creation, or a semaphore
    /// attempt's put sent again after a lost answer, which rewrote it. Any later change is
    /// someone else's.
    pub(super) written: i64,
    /// Fires when the key was found deleted or changed by someone else.
    ended: CancellationToken,
    /// How many times the watch could not vouch for the key (its history was compacted away,
    /// or etcd refused the watch).
    doubts: AtomicU64,
    /// How many of those doubts a read of the key has answered since.
    answered: AtomicU64,
}

impl HeldKey {
    pub(super) fn new(key: Vec<u8>, created: i64, written: i64) -> Self {
        HeldKey {
            key,
            created,
            written,
            ended: CancellationToken::new(),
            doubts: AtomicU64::new(0),
            answered: AtomicU64::new(0),
        }
    }

    /// Fires when someone else deleted or changed the key.
    pub(super) fn ended(&self) -> &CancellationToken {
        &self.ended
    }

    /// Whether someone else deleted or changed the key.
    pub(super) fn is_ended(&self) -> bool {
        self.ended.is_cancelled()
    }

    /// The watch reported a change made at `mod_revision`: the hold ends unless that is the
    /// holder's own write, which a watch from [`written`](Self::written) replays first.
    pub(super) fn changed_at(&self, mod_revision: i64) {
        if mod_revision > self.written {
            self.ended.cancel();
        }
    }

    /// The watch can no longer vouch for the key: it must be read before the hold is trusted.
    pub(super) fn doubt(&self) {
        self.doubts.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether a doubt is still unanswered.
    pub(super) fn doubted(&self) -> bool {
        self.answered.load(Ordering::Acquire) < self.doubts.load(Ordering::Acquire)
    }

    /// Reads the key and ends the hold unless it is exactly what the holder wrote (same create
    /// revision, no write since). The answer settles every doubt raised before the read was
    /// sent; `Err` when etcd did not answer, and the doubts stay.
    pub(super) async fn check(&self, members: &Members) -> Result<(), BackendError> {
        let doubts = self.doubts.load(Ordering::Acquire);
        let read = members
            .call("held key check", Resend::Idempotent, |client| {
                let (mut kv, key) = (client.kv_client(), self.key.clone());
                async move { kv.get(key, Some(GetOptions::new().with_keys_only())).await }
            })
            .await?;
        let unchanged = read.kvs().first().is_some_and(|kv| {
            kv.create_revision() == self.created && kv.mod_revision() == self.written
        });
        if !unchanged {
            self.ended.cancel();
        }
        self.answered.fetch_max(doubts, Ordering::AcqRel);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holders_own_write_replayed_by_its_watch_is_no_loss() {
        let held = HeldKey::new(b"k".to_vec(), 10, 12);
        held.changed_at(12);
        assert!(!held.is_ended());
        held.changed_at(13);
        assert!(held.is_ended());
    }

    #[test]
    fn a_doubted_hold_stays_doubted_until_a_read_answers() {
        let held = HeldKey::new(b"k".to_vec(), 10, 10);
        assert!(!held.doubted());
        held.doubt();
        held.doubt();
        assert!(held.doubted());
    }
}
