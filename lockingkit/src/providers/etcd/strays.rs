//! Keys that must go but whose delete has not been confirmed: a release that went unanswered,
//! a key an attempt may have written without hearing so, a queue place whose wait ended while
//! the cluster was out of reach.
//!
//! The backend's one lease keeps every such key alive for as long as the backend holds
//! anything, so nobody else would ever delete it: one retrier per backend deletes them in the
//! background until etcd confirms or their lease is gone (which deletes them anyway). Each
//! round sends one delete per key to one member (no resends: the round itself is the retry),
//! and rounds back off from [`FIRST_DELAY`] to [`MOST_DELAY`] while deletes fail.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use tokio::sync::Notify;

use super::lease::LeaseGeneration;
use super::members::Resend;
use super::Inner;
use crate::backoff::Backoff;

/// The pause after a round in which a delete failed; it doubles up to [`MOST_DELAY`].
const FIRST_DELAY: Duration = Duration::from_millis(100);
const MOST_DELAY: Duration = Duration::from_secs(5);

/// A key to delete.
pub(super) struct Stray {
    pub(super) key: Vec<u8>,
    /// The lease the key is on: once it is gone, so is the key.
    pub(super) generation: Arc<LeaseGeneration>,
    /// The key's create revision when known: the delete then applies only to that key, never
    /// to one created later under the same name.
    pub(super) created: Option<i64>,
}

#[derive(Default)]
pub(super) struct Strays {
    state: Mutex<State>,
    retrying: AtomicBool,
    /// Notified whenever the last stray is settled.
    settled: Notify,
}

#[derive(Default)]
struct State {
    queued: Vec<Stray>,
    /// Deletes of the current round, not yet answered.
    in_flight: usize,
}

impl Strays {
    fn state(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keys not yet confirmed deleted (queued or being deleted now).
    pub(super) fn pending(&self) -> usize {
        let state = self.state();
        state.queued.len() + state.in_flight
    }

    /// Waits until no key is pending, or `deadline`; `false` at the deadline.
    pub(super) async fn settled_by(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            let settled = self.settled.notified();
            if self.pending() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, settled).await.is_err() {
                return self.pending() == 0;
            }
        }
    }
}

impl Inner {
    /// Deletes `stray` in the background (see the module documentation).
    pub(super) fn delete_later(self: &Arc<Self>, stray: Stray) {
        self.strays.state().queued.push(stray);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.strays.retrying.swap(true, Ordering::AcqRel) {
            runtime.spawn(retry_strays(self.clone()));
        }
    }

    /// Deletes `stray` now, or leaves it to the background retries.
    pub(super) async fn delete_or_later(self: &Arc<Self>, stray: Stray) {
        if !self.delete_once(&stray, Resend::Idempotent).await {
            self.delete_later(stray);
        }
    }

    /// One delete of `stray`: `true` when etcd confirmed it (or its lease is gone).
    async fn delete_once(&self, stray: &Stray, resend: Resend) -> bool {
        if stray.generation.is_gone() {
            return true;
        }
        let txn = delete_txn(stray);
        self.members
            .call("delete", resend, |client| {
                let (mut kv, txn) = (client.kv_client(), txn.clone());
                async move { kv.txn(txn).await }
            })
            .await
            .is_ok()
    }
}

/// The delete of one key, compared on its create revision when it is known.
fn delete_txn(stray: &Stray) -> Txn {
    let delete = TxnOp::delete(stray.key.clone(), None);
    match stray.created {
        Some(created) => Txn::new()
            .when([Compare::create_revision(
                stray.key.clone(),
                CompareOp::Equal,
                created,
            )])
            .and_then([delete]),
        None => Txn::new().and_then([delete]),
    }
}

async fn retry_strays(backend: Arc<Inner>) {
    let mut backoff = Backoff::new(FIRST_DELAY, MOST_DELAY);
    loop {
        let due = {
            let mut state = backend.strays.state();
            let due = std::mem::take(&mut state.queued);
            state.in_flight = due.len();
            due
        };
        let mut left = Vec::new();
        for stray in due {
            if !backend.delete_once(&stray, Resend::Never).await {
                left.push(stray);
            }
            backend.strays.state().in_flight -= 1;
        }
        let failed = !left.is_empty();
        let done = {
            let mut state = backend.strays.state();
            state.queued.extend(left);
            let done = state.queued.is_empty();
            if done {
                backend.strays.retrying.store(false, Ordering::Release);
            }
            done
        };
        if done {
            backend.strays.settled.notify_waiters();
            return;
        }
        if failed {
            tokio::time::sleep(backoff.next_delay()).await;
        } else {
            backoff.reset();
        }
    }
}
