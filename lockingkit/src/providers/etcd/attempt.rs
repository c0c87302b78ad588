//! The transactions of one attempt and of a release, per lock mode.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, TxnResponse,
};
use tokio_util::sync::CancellationToken;

use super::errors::bounded;
use super::layout::{range_end, Directory};
use super::lease::LeaseGeneration;
use super::queue::{Place, Turn};
use super::{EtcdLease, Inner};
use crate::backend::{Acquired, BackendError, LockMode};

/// The first pause before an unanswered delete is sent again; it doubles up to
/// [`STRAY_RETRY_MAX`].
const STRAY_RETRY_FIRST: Duration = Duration::from_millis(100);
const STRAY_RETRY_MAX: Duration = Duration::from_secs(5);

/// What an attempt found: a hold, busy, or (for a lease the server had dropped) a retry.
enum Found {
    Held(EtcdLease),
    Busy,
    LeaseGone,
}

impl Inner {
    /// One attempt to take `key` in `mode`.
    pub(super) async fn attempt(
        self: &Arc<Self>,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<EtcdLease>>, BackendError> {
        let client = self.client().await?;
        // A lease the server dropped while nothing renewed it is found by the first write on
        // it; the attempt then runs once more on a new lease.
        for _ in 0..2 {
            let generation = self.lease.fresh(&client).await?;
            let found = match mode {
                LockMode::Exclusive => self.attempt_writer(&client, key, &generation).await?,
                LockMode::Shared => self.attempt_reader(&client, key, &generation).await?,
                LockMode::Semaphore { max_count } => {
                    self.attempt_slot(&client, key, max_count, &generation)
                        .await?
                }
            };
            match found {
                Found::Held(lease) => {
                    let fencing_token = u64::try_from(lease.revision).unwrap_or(0);
                    return Ok(Some(Acquired {
                        lease,
                        fencing_token,
                    }));
                }
                Found::Busy => {
                    if mode == LockMode::Exclusive {
                        self.queue.writer_busy(key);
                    }
                    return Ok(None);
                }
                Found::LeaseGone => generation.mark_gone(),
            }
        }
        Err(BackendError::transient(
            "etcd dropped the backend's lease twice in one attempt",
        ))
    }

    /// A writer: through its queue place if it has one, else by creating its key if the
    /// directory is empty.
    async fn attempt_writer(
        self: &Arc<Self>,
        client: &Client,
        key: &str,
        generation: &Arc<LeaseGeneration>,
    ) -> Result<Found, BackendError> {
        let directory = Directory::lock(&self.key_prefix, key);
        if let Some(place) = self.queue.claim(key, generation) {
            let turn = self.place_turn(client, &directory, &place).await;
            self.settle_place(key, turn.as_ref().ok());
            return Ok(match turn? {
                Turn::Held => {
                    Found::Held(self.lease(place.key, place.revision, generation.clone()))
                }
                Turn::Waiting | Turn::PlaceGone => Found::Busy,
            });
        }
        let empty = Compare::create_revision(directory.all.clone(), CompareOp::Equal, 0)
            .with_range(range_end(&directory.all));
        self.create_if(client, &directory.writers, empty, generation)
            .await
    }

    /// A reader: creates its key if no writer holds or waits.
    async fn attempt_reader(
        self: &Arc<Self>,
        client: &Client,
        key: &str,
        generation: &Arc<LeaseGeneration>,
    ) -> Result<Found, BackendError> {
        let directory = Directory::lock(&self.key_prefix, key);
        let no_writer = Compare::create_revision(directory.writers.clone(), CompareOp::Equal, 0)
            .with_range(range_end(&directory.writers));
        self.create_if(client, &directory.readers, no_writer, generation)
            .await
    }

    /// Creates a key under `within` on the lease if `condition` holds (a range compare of
    /// create revisions against 0 is true exactly when the range is empty).
    async fn create_if(
        self: &Arc<Self>,
        client: &Client,
        within: &[u8],
        condition: Compare,
        generation: &Arc<LeaseGeneration>,
    ) -> Result<Found, BackendError> {
        let key = Directory::entry(within, &generation.next_entry_id());
        let put = TxnOp::put(
            key.clone(),
            Vec::new(),
            Some(PutOptions::new().with_lease(generation.id)),
        );
        let txn = Txn::new().when([condition]).and_then([put]);
        let Some(answer) = self
            .unless_unanswered(client, "lock attempt", txn, &key, generation)
            .await?
        else {
            return Ok(Found::LeaseGone);
        };
        if !answer.succeeded() {
            return Ok(Found::Busy);
        }
        // The put is the transaction's only write: the key's create revision is the
        // transaction's revision.
        let revision = answer.header().map_or(0, |h| h.revision());
        Ok(Found::Held(self.lease(key, revision, generation.clone())))
    }

    /// Whether the queue place's turn has come: it is the oldest key of the directory and no
    /// reader holds. Once true this stays true for as long as the place exists (only newer
    /// keys can appear, and a reader only where no writer is older than it), so a read decides.
    async fn place_turn(
        &self,
        client: &Client,
        directory: &Directory,
        place: &Place,
    ) -> Result<Turn, BackendError> {
        let oldest = GetOptions::new()
            .with_range(range_end(&directory.all))
            .with_sort(SortTarget::Create, SortOrder::Ascend)
            .with_limit(1)
            .with_keys_only();
        let readers = GetOptions::new()
            .with_range(range_end(&directory.readers))
            .with_limit(1)
            .with_keys_only();
        let own = GetOptions::new().with_keys_only();
        let txn = Txn::new().and_then([
            TxnOp::get(directory.all.clone(), Some(oldest)),
            TxnOp::get(directory.readers.clone(), Some(readers)),
            TxnOp::get(place.key.clone(), Some(own)),
        ]);
        let answer = self
            .txn(client, "queued lock attempt", txn)
            .await?
            .ok_or_else(|| BackendError::transient("etcd dropped the backend's lease"))?;
        let gets = gets(&answer);
        let [Some(oldest), Some(readers), Some(own)] = [gets.first(), gets.get(1), gets.get(2)]
        else {
            return Err(BackendError::permanent(
                "unexpected answer to the queued lock attempt",
            ));
        };
        if own.is_empty() {
            return Ok(Turn::PlaceGone);
        }
        let first = oldest
            .first()
            .is_some_and(|k| k.key() == place.key.as_slice());
        Ok(if first && readers.is_empty() {
            Turn::Held
        } else {
            Turn::Waiting
        })
    }

    /// A semaphore holder: a key of its own, kept if it is among the `max_count` oldest.
    async fn attempt_slot(
        self: &Arc<Self>,
        client: &Client,
        key: &str,
        max_count: u32,
        generation: &Arc<LeaseGeneration>,
    ) -> Result<Found, BackendError> {
        let directory = Directory::semaphore(&self.key_prefix, key);
        let end = range_end(&directory.all);
        // A full semaphore is answered by a read, writing nothing.
        let count = GetOptions::new().with_range(end.clone()).with_count_only();
        let holders = bounded("semaphore count", self.timeout, || {
            let (mut kv, key, count) = (client.kv_client(), directory.all.clone(), count.clone());
            async move { kv.get(key, Some(count)).await }
        })
        .await?;
        if holders.count() >= i64::from(max_count) {
            return Ok(Found::Busy);
        }
        let slot = Directory::entry(&directory.all, &generation.next_entry_id());
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
        let Some(answer) = self
            .unless_unanswered(client, "semaphore attempt", txn, &slot, generation)
            .await?
        else {
            return Ok(Found::LeaseGone);
        };
        let revision = answer.header().map_or(0, |h| h.revision());
        let admitted = gets(&answer)
            .first()
            .is_some_and(|oldest| oldest.iter().any(|k| k.key() == slot.as_slice()));
        if admitted {
            return Ok(Found::Held(self.lease(slot, revision, generation.clone())));
        }
        // Older holders filled it between the count and the transaction: give the key back.
        self.delete_or_keep_trying(client, slot, generation).await;
        Ok(Found::Busy)
    }

    /// Sends `txn`; `None` when etcd says the lease it names is gone.
    async fn txn(
        &self,
        client: &Client,
        what: &'static str,
        txn: Txn,
    ) -> Result<Option<TxnResponse>, BackendError> {
        let sent = bounded(what, self.timeout, || {
            let (mut kv, txn) = (client.kv_client(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await;
        match sent {
            Ok(answer) => Ok(Some(answer)),
            Err(error) if error.kind() == crate::backend::BackendErrorKind::LeaseGone => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Sends a transaction that may create `key`. If it goes unanswered it may still have
    /// created the key, which nobody would ever delete while the shared lease lives: the key
    /// is left to the background deletes.
    async fn unless_unanswered(
        self: &Arc<Self>,
        client: &Client,
        what: &'static str,
        txn: Txn,
        key: &[u8],
        generation: &Arc<LeaseGeneration>,
    ) -> Result<Option<TxnResponse>, BackendError> {
        let answer = self.txn(client, what, txn).await;
        if answer.as_ref().is_err_and(|e| !e.reached()) {
            self.strays.add(self, key.to_vec(), generation.clone());
        }
        answer
    }

    fn lease(
        self: &Arc<Self>,
        key: Vec<u8>,
        revision: i64,
        generation: Arc<LeaseGeneration>,
    ) -> EtcdLease {
        EtcdLease {
            key,
            revision,
            generation,
            ended: CancellationToken::new(),
            watch: Mutex::new(None),
            watching: AtomicBool::new(false),
            released: AtomicBool::new(false),
            backend: Arc::downgrade(self),
        }
    }

    /// Deletes the hold's key. A delete that goes unanswered leaves the key to the background
    /// retries of [`Strays`]: the shared lease would otherwise keep it alive.
    pub(super) async fn release(self: &Arc<Self>, lease: &EtcdLease) -> Result<(), BackendError> {
        if lease.released.swap(true, Ordering::AcqRel) {
            return Err(BackendError::lease_gone("the lock was already released"));
        }
        lease.unwatch(self);
        let client = self.client().await?;
        match bounded("release", self.timeout, || delete(&client, &lease.key)).await {
            Ok(deleted) if deleted.deleted() > 0 => Ok(()),
            Ok(_) => Err(BackendError::lease_gone(
                "the lock's etcd key was already gone (its lease expired, or another client deleted it)",
            )),
            Err(error) => {
                self.strays.add(self, lease.key.clone(), lease.generation.clone());
                Err(error)
            }
        }
    }

    /// Deletes `key` now, or leaves it to the background retries.
    pub(super) async fn delete_or_keep_trying(
        self: &Arc<Self>,
        client: &Client,
        key: Vec<u8>,
        generation: &Arc<LeaseGeneration>,
    ) {
        if bounded("delete", self.timeout, || delete(client, &key))
            .await
            .is_err()
        {
            self.strays.add(self, key, generation.clone());
        }
    }
}

/// A delete of one key, as a request that can be sent again.
fn delete(
    client: &Client,
    key: &[u8],
) -> impl std::future::Future<Output = Result<etcd_client::DeleteResponse, etcd_client::Error>> {
    let (mut kv, key) = (client.kv_client(), key.to_vec());
    async move { kv.delete(key, None).await }
}

/// The `Get` answers of a transaction, in order.
fn gets(answer: &TxnResponse) -> Vec<Vec<etcd_client::KeyValue>> {
    answer
        .op_responses()
        .into_iter()
        .filter_map(|op| match op {
            TxnOpResponse::Get(get) => Some(get.kvs().to_vec()),
            _ => None,
        })
        .collect()
}

/// Keys whose delete went unanswered: retried in the background until etcd confirms, or their
/// lease is gone (which deletes them anyway). One retrier per backend.
#[derive(Default)]
pub(super) struct Strays {
    keys: Mutex<Vec<(Vec<u8>, Arc<LeaseGeneration>)>>,
    retrying: AtomicBool,
}

impl Strays {
    pub(super) fn add(&self, backend: &Arc<Inner>, key: Vec<u8>, generation: Arc<LeaseGeneration>) {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((key, generation));
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.retrying.swap(true, Ordering::AcqRel) {
            runtime.spawn(retry_strays(backend.clone()));
        }
    }

    /// Keys still waiting for a confirmed delete.
    pub(super) fn pending(&self) -> usize {
        self.keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

async fn retry_strays(backend: Arc<Inner>) {
    let mut delay = STRAY_RETRY_FIRST;
    loop {
        let due: Vec<_> = std::mem::take(
            &mut *backend
                .strays
                .keys
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let mut left = Vec::new();
        for (key, generation) in due {
            if generation.is_gone() {
                continue;
            }
            let deleted = match backend.client().await {
                Ok(client) => bounded("delete", backend.timeout, || delete(&client, &key))
                    .await
                    .is_ok(),
                Err(_) => false,
            };
            if !deleted {
                left.push((key, generation));
            }
        }
        let done = {
            let mut keys = backend
                .strays
                .keys
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            keys.extend(left);
            if keys.is_empty() {
                backend.strays.retrying.store(false, Ordering::Release);
            }
            keys.is_empty()
        };
        if done {
            return;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(STRAY_RETRY_MAX);
    }
}
