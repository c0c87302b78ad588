//! Attempts whose callers went away, still running in the background, per key.
//!
//! An attempt whose caller leaves goes on (see `background`), and the lock it may win for
//! nobody is released after it. Until then the key is not as the callers that come next would
//! find it: a reader's abandoned attempt that lands after the holder's release takes the key
//! for nobody, and a writer's try meanwhile would be told "busy". Callers of the same lane wait
//! for such an attempt already (it keeps the lane's turn until its release is done); callers
//! of the key's other lanes wait here, before their own attempt.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;
use tokio::time::Instant;

/// The abandoned attempts of one engine, by key.
#[derive(Debug, Default)]
pub(crate) struct Abandoned {
    /// How many are running, so that the usual case (none) costs one load.
    running: AtomicUsize,
    /// The count per key, while it is above zero.
    keys: Mutex<HashMap<Arc<str>, watch::Sender<usize>>>,
}

/// One abandoned attempt of a key, counted until dropped.
pub(crate) struct Running {
    abandoned: Arc<Abandoned>,
    count: watch::Sender<usize>,
}

impl Abandoned {
    fn keys(&self) -> MutexGuard<'_, HashMap<Arc<str>, watch::Sender<usize>>> {
        // Each critical section leaves the map consistent.
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts an attempt on `key` as abandoned and running until the guard is dropped.
    pub(crate) fn start(self: &Arc<Self>, key: &Arc<str>) -> Running {
        let mut keys = self.keys();
        keys.retain(|_, count| *count.borrow() > 0);
        let count = keys
            .entry(key.clone())
            .or_insert_with(|| watch::channel(0).0)
            .clone();
        count.send_modify(|count| *count = count.saturating_add(1));
        self.running.fetch_add(1, Ordering::AcqRel);
        Running {
            abandoned: self.clone(),
            count,
        }
    }

    /// Resolves once no abandoned attempt on `key` is running, or at `by`.
    pub(crate) async fn settled(&self, key: &str, by: Instant) {
        if self.running.load(Ordering::Acquire) == 0 {
            return;
        }
        let count = self.keys().get(key).map(watch::Sender::subscribe);
        if let Some(mut count) = count {
            // The sender lives in the map or in a guard while the count is above zero.
            let _ = tokio::time::timeout_at(by, count.wait_for(|count| *count == 0)).await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.count
            .send_modify(|count| *count = count.saturating_sub(1));
        self.abandoned.running.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Shared by an attempt in flight and its caller: whether the caller went away before the
/// answer, and then the count of the attempt as abandoned, which lasts as long as the last
/// holder of this (the attempt and the release of what it won).
#[derive(Default)]
pub(crate) struct Gone {
    left: AtomicBool,
    running: Mutex<Option<Running>>,
}

impl Gone {
    /// Whether the caller went away before the answer.
    pub(crate) fn left(&self) -> bool {
        self.left.load(Ordering::Acquire)
    }

    /// The caller goes away: the attempt counts as `running` until it and its clean-up end.
    pub(crate) fn leave(&self, running: Running) {
        self.left.store(true, Ordering::Release);
        *self.running.lock().unwrap_or_else(PoisonError::into_inner) = Some(running);
    }
}
