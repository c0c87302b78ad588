//! A lock on an in-memory store through a backend that a test watches.

use lockingkit::testing::Intercept;
use lockingkit::{DistributedLock, MemoryBackend, MemoryStore};

/// What a test watches its backend with: it wraps a store's backend in its own interceptions.
pub trait Watch {
    /// The backend of `store`, watched by `self`.
    fn backend(&self, store: &MemoryStore) -> Intercept<MemoryBackend>;
}

/// A fresh store, `watch`, and a lock on the store's backend as `watch` wraps it.
pub fn watched<W: Watch>(watch: W) -> (MemoryStore, W, DistributedLock) {
    let store = MemoryStore::new();
    let locks = DistributedLock::builder(watch.backend(&store))
        .build()
        .expect("the default options are valid");
    (store, watch, locks)
}
