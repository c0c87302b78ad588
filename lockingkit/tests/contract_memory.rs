//! The contract suite against the in-memory provider: four "processes" share one store.

#![cfg(feature = "testing")]

use std::time::Duration;

use lockingkit::testing::ContractBackend;
use lockingkit::{DistributedLock, LockOptions, MemoryBackend, MemoryStore};

/// Short leases so the renewal case covers three lease periods in a few seconds.
const LEASE: Duration = Duration::from_millis(600);

struct InMemory {
    store: MemoryStore,
}

impl ContractBackend for InMemory {
    async fn new_process(&self, options: LockOptions) -> DistributedLock {
        DistributedLock::builder(MemoryBackend::with_lease(self.store.clone(), LEASE))
            .options(options)
            .build()
            .expect("contract options are valid")
    }

    fn lease_period(&self) -> Duration {
        LEASE
    }
}

lockingkit::contract_tests!(async {
    InMemory {
        store: MemoryStore::new(),
    }
});
