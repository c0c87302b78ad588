//! The transactions of one attempt, per lock mode, and of a release.

use std::sync::Arc;

use etcd_client::{
    Compare, CompareOp, GetOptions, KeyValue, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, TxnResponse,
};

use super::errors::Failure;
use super::layout::{entry, range_end, LockDirectory, SemaphoreDirectory};
use super::lease::LeaseGeneration;
use super::line::{Claimed, Line, Place, Side, Turn, WaitId};
use super::members::{Members, Resend};
use super::strays::Stray;
use super::{EtcdLease, Inner};
use crate::backend::{Acquired, BackendError, BackendErrorKind};

/// What an attempt found: a hold, busy, or (for a lease the server had dropped) a retry.
pub(super) enum Found {
    Held(EtcdLease),
    Busy,
    LeaseGone,
}

/// Sends one transaction, to each member at most once (see `members`).
pub(super) async fn send_txn(
    members: &Members,
    what: &'static str,
    resend: Resend,
    txn: Txn,
) -> Result<TxnResponse, Failure> {
    members
        .call(what, resend, |client| {
            let (mut kv, txn) = (client.kv_client(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await
}

/// The `Get` answers of a transaction, in order.
pub(super) fn gets(answer: &TxnResponse) -> Vec<Vec<KeyValue>> {
    answer
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.kvs().to_vec()),
            _ => None,
        })
        .collect()
}

impl Inner {
    /// One attempt on the lock of `id.key()`, on the side `id` names: through the place of the
    /// wait `serial` if it has one, else as a newcomer.
    pub(super) async fn attempt_lock(
        self: &Arc<Self>,
        line: &Line,
        id: &WaitId,
        serial: Option<u64>,
        generation: &Arc<LeaseGeneration>,
    ) -> Result<Found, BackendError> {
        let directory = LockDirectory::new(&self.key_prefix, id.key());
        if let Some(claimed) = serial.and_then(|serial| self.claim(line, serial, generation)) {
            return self.attempt_in_line(line, &directory, claimed).await;
        }
        let found = self
            .create_if_free(&directory, id.side(), generation)
            .await?;
        let Some(serial) = serial else {
            return Ok(found);
        };
        match &found {
            Found::Busy => line.wants_place(serial),
            Found::Held(_) => {
                if let Some(orphan) = self.won_without_place(line, serial) {
                    self.delete_orphan_soon(orphan);
                }
            }
            Found::LeaseGone => {}
        }
        // A place the wait no longer needs may still be on its way out: the hold's release is
        // confirmed only once it is gone too, so nothing this process left refuses the next
        // caller anywhere.
        Ok(match found {
            Found::Held(lease) => Found::Held(lease.settling_first(line.leaving_now(id.key()))),
            other => other,
        })
    }

    /// An attempt through a claimed place: one read decides.
    async fn attempt_in_line(
        self: &Arc<Self>,
        line: &Line,
        directory: &LockDirectory,
        claimed: Claimed,
    ) -> Result<Found, BackendError> {
        let turn = self.place_turn(directory, &claimed).await;
        let mut orphan = None;
        let held = self.settle(line, claimed, turn.as_ref().ok(), &mut orphan);
        if let Some(orphan) = orphan {
            self.delete_orphan_soon(orphan);
        }
        turn?;
        Ok(match held {
            // A place is written once (never sent again), and becomes the hold as it is.
            Some((place, leaving)) => Found::Held(
                self.lease(
                    place.key,
                    (place.revision, place.revision),
                    place.generation,
                )
                .keeping(leaving),
            ),
            None => Found::Busy,
        })
    }

    /// Whether a place holds now: its key still exists and no key it waits for is older.
    async fn place_turn(
        &self,
        directory: &LockDirectory,
        claimed: &Claimed,
    ) -> Result<Turn, BackendError> {
        let place: &Place = &claimed.place;
        let ahead = claimed.side().ahead_range(directory);
        let newest_older = GetOptions::new()
            .with_range(range_end(ahead))
            .with_max_create_revision(place.revision.saturating_sub(1))
            .with_sort(SortTarget::Create, SortOrder::Descend)
            .with_limit(1)
            .with_keys_only();
        let txn = Txn::new().and_then([
            TxnOp::get(place.key.clone(), Some(GetOptions::new().with_keys_only())),
            TxnOp::get(ahead.to_vec(), Some(newest_older)),
        ]);
        let answer = send_txn(
            &self.members,
            "queued lock attempt",
            Resend::Idempotent,
            txn,
        )
        .await?;
        let after = answer.header().map_or(0, |h| h.revision());
        let gets = gets(&answer);
        let (Some(own), Some(older)) = (gets.first(), gets.get(1)) else {
            return Err(BackendError::permanent(
                "unexpected answer to the queued lock attempt",
            ));
        };
        Ok(match (own.is_empty(), older.first()) {
            (true, _) => Turn::PlaceGone,
            (false, None) => Turn::Held,
            (false, Some(ahead)) => Turn::Waiting {
                ahead: ahead.key().to_vec(),
                after,
            },
        })
    }

    /// A newcomer: creates its key only where it holds at once — a writer in an empty
    /// directory, a reader where no writer is (a range compare of create revisions against 0
    /// is true exactly when the range is empty). A busy answer writes nothing. The transaction
    /// reads its own key when it finds the lock taken, so a second send after a first whose
    /// answer was lost finds the hold the first one made.
    async fn create_if_free(
        self: &Arc<Self>,
        directory: &LockDirectory,
        side: Side,
        generation: &Arc<LeaseGeneration>,
    ) -> Result<Found, BackendError> {
        let blockers = side.ahead_range(directory);
        let free = Compare::create_revision(blockers.to_vec(), CompareOp::Equal, 0)
            .with_range(range_end(blockers));
        let key = entry(side.within(directory), &generation.next_entry_id());
        let put = TxnOp::put(
            key.clone(),
            Vec::new(),
            Some(PutOptions::new().with_lease(generation.id)),
        );
        let own = TxnOp::get(key.clone(), Some(GetOptions::new().with_keys_only()));
        let txn = Txn::new().when([free]).and_then([put]).or_else([own]);
        let Some(answer) = self
            .writing("lock attempt", Resend::Idempotent, txn, &key, generation)
            .await?
        else {
            return Ok(Found::LeaseGone);
        };
        if !answer.succeeded() {
            let earlier = gets(&answer)
                .first()
                .and_then(|own| own.first())
                .map(|kv| (kv.create_revision(), kv.mod_revision()));
            return Ok(match earlier {
                Some(revisions) if revisions.0 > 0 => {
                    Found::Held(self.lease(key, revisions, generation.clone()))
                }
                _ => Found::Busy,
            });
        }
        // The put is the transaction's only write: the key's create revision is the
        // transaction's revision.
        let revision = self.written_revision(&answer, &key, generation)?;
        Ok(Found::Held(self.lease(
            key,
            (revision, revision),
            generation.clone(),
        )))
    }

    /// A semaphore holder: a key of its own, kept if it is among the `max_count` oldest.
    /// Waiters for a semaphore poll: a semaphore has no queue places.
    pub(super) async fn attempt_slot(
        self: &Arc<Self>,
        key: &str,
        max_count: u32,
        generation: &Arc<LeaseGeneration>,
    ) -> Result<Found, BackendError> {
        let directory = SemaphoreDirectory::new(&self.key_prefix, key);
        let end = range_end(&directory.all);
        // A full semaphore is answered by a read, writing nothing.
        let count = GetOptions::new().with_range(end.clone()).with_count_only();
        let holders = self
            .members
            .call("semaphore count", Resend::Idempotent, |client| {
                let (mut kv, key, count) =
                    (client.kv_client(), directory.all.clone(), count.clone());
                async move { kv.get(key, Some(count)).await }
            })
            .await?;
        if holders.count() >= i64::from(max_count) {
            return Ok(Found::Busy);
        }
        let slot = entry(&directory.all, &generation.next_entry_id());
        let oldest = GetOptions::new()
            .with_range(end)
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(i64::from(max_count))
            .with_keys_only();
        let txn = Txn::new().and_then([
            TxnOp::put(
                slot.clone(),
                Vec::new(),
                Some(PutOptions::new().with_lease(generation.id)),
            ),
            TxnOp::get(directory.all.clone(), Some(oldest)),
        ]);
        // Sent again after a lost answer, the put only rewrites the key: its create revision,
        // read back among the oldest, stays the first send's.
        let Some(answer) = self
            .writing(
                "semaphore attempt",
                Resend::Idempotent,
                txn,
                &slot,
                generation,
            )
            .await?
        else {
            return Ok(Found::LeaseGone);
        };
        self.written_revision(&answer, &slot, generation)?;
        // A put sent again rewrote the slot: the watch starts at that write, not its creation.
        let admitted = gets(&answer).first().and_then(|oldest| {
            oldest
                .iter()
                .find(|k| k.key() == slot.as_slice())
                .map(|kv| (kv.create_revision(), kv.mod_revision()))
        });
        if let Some(revisions) = admitted.filter(|(created, _)| *created > 0) {
            return Ok(Found::Held(self.lease(slot, revisions, generation.clone())));
        }
        // Older holders filled it between the count and the transaction: give the key back.
        self.delete_or_later(Stray {
            key: slot,
            generation: generation.clone(),
            created: None,
        })
        .await;
        Ok(Found::Busy)
    }

    /// Sends a transaction that may create `key`; `None` when etcd says the lease it names is
    /// gone. A failure that may have applied leaves the key to the background deletes: nobody
    /// else would ever delete it while the shared lease lives.
    async fn writing(
        self: &Arc<Self>,
        what: &'static str,
        resend: Resend,
        txn: Txn,
        key: &[u8],
        generation: &Arc<LeaseGeneration>,
    ) -> Result<Option<TxnResponse>, BackendError> {
        match send_txn(&self.members, what, resend, txn).await {
            Ok(answer) => Ok(Some(answer)),
            Err(failure) if failure.error.kind() == BackendErrorKind::LeaseGone => Ok(None),
            Err(failure) => {
                if !failure.had_no_effect() {
                    self.delete_later(Stray {
                        key: key.to_vec(),
                        generation: generation.clone(),
                        created: None,
                    });
                }
                Err(failure.error)
            }
        }
    }

    /// The create revision of the key a transaction just wrote, which is the fencing token.
    /// etcd always sends it; an answer without one is a permanent failure, never a token of 0,
    /// and the key (written, but unusable) is deleted.
    fn written_revision(
        self: &Arc<Self>,
        answer: &TxnResponse,
        key: &[u8],
        generation: &Arc<LeaseGeneration>,
    ) -> Result<i64, BackendError> {
        match answer.header().map(|h| h.revision()) {
            Some(revision) if revision > 0 => Ok(revision),
            _ => {
                self.delete_later(Stray {
                    key: key.to_vec(),
                    generation: generation.clone(),
                    created: None,
                });
                Err(BackendError::permanent(
                    "etcd answered the lock attempt without a revision",
                ))
            }
        }
    }

    /// Deletes the hold's key, compared on its create revision so that a late release never
    /// deletes a key created later under the same name. Once etcd answers (deleted, or already
    /// gone) the key's fate is settled; otherwise it is left to the background deletes.
    pub(super) async fn release(self: &Arc<Self>, lease: &EtcdLease) -> Result<(), BackendError> {
        if lease.release_started() {
            return Err(BackendError::lease_gone("the lock was already released"));
        }
        lease.unwatch(self);
        let key = &lease.held.key;
        let delete = Txn::new()
            .when([Compare::create_revision(
                key.clone(),
                CompareOp::Equal,
                lease.held.created,
            )])
            .and_then([TxnOp::delete(key.clone(), None)]);
        let answered = send_txn(&self.members, "release", Resend::Idempotent, delete).await;
        lease.places_gone().await;
        match answered {
            Ok(answer) => {
                lease.settle();
                if answer.succeeded() {
                    Ok(())
                } else {
                    Err(BackendError::lease_gone(
                        "the lock's etcd key was already gone (its lease expired, or another client deleted it)",
                    ))
                }
            }
            Err(failure) => {
                lease.settle();
                self.delete_later(lease.stray());
                Err(failure.error)
            }
        }
    }

    /// The lease of a hold won just now.
    pub(super) fn acquired(
        self: &Arc<Self>,
        lease: EtcdLease,
    ) -> Result<Acquired<EtcdLease>, BackendError> {
        match u64::try_from(lease.held.created) {
            Ok(fencing_token) if fencing_token > 0 => Ok(Acquired {
                lease,
                fencing_token,
            }),
            // Never reached (revisions are checked where keys are written); the lease's drop
            // deletes the key.
            _ => Err(BackendError::permanent(
                "etcd gave the hold's key no revision",
            )),
        }
    }
}
