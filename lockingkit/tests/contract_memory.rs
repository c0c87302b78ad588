//! The contract suite against the in-memory provider: four "processes" share one store.
//!
//! Built only with the `testing` feature (`required-features` in Cargo.toml), so a run without
//! it leaves this suite out by name instead of running an empty binary.

use std::time::Duration;

use lockingkit::backend::{Acquired, BackendError, LeaseTiming, LockBackend};
use lockingkit::testing::ContractBackend;
use lockingkit::{DistributedLock, LockMode, LockOptions, MemoryBackend, MemoryStore};

/// Short leases so the renewal case covers three lease periods in a few seconds.
const LEASE: Duration = Duration::from_millis(600);

/// How long each request takes to reach the store, and its answer to come back.
const ONE_WAY: Duration = Duration::from_millis(1);

/// The in-memory backend behind a simulated network. The store answers within a single poll,
/// so without this a caller could never go away while its attempt is in flight, and the
/// cancellation cases would not exercise the release of a lease won by an abandoned attempt.
struct RoundTrip(MemoryBackend);

impl RoundTrip {
    fn new(store: &MemoryStore) -> Self {
        RoundTrip(MemoryBackend::with_lease(store.clone(), LEASE))
    }
}

impl LockBackend for RoundTrip {
    type Lease = <MemoryBackend as LockBackend>::Lease;

    fn provider(&self) -> &str {
        self.0.provider()
    }

    fn timing(&self) -> LeaseTiming {
        self.0.timing()
    }

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<Self::Lease>>, BackendError> {
        tokio::time::sleep(ONE_WAY).await;
        let answer = self.0.try_acquire(key, mode).await;
        tokio::time::sleep(ONE_WAY).await;
        answer
    }

    fn supports(&self, mode: LockMode) -> bool {
        self.0.supports(mode)
    }

    async fn renew(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        tokio::time::sleep(ONE_WAY).await;
        let answer = self.0.renew(lease).await;
        tokio::time::sleep(ONE_WAY).await;
        answer
    }

    async fn release(&self, lease: &Self::Lease) -> Result<(), BackendError> {
        tokio::time::sleep(ONE_WAY).await;
        let answer = self.0.release(lease).await;
        tokio::time::sleep(ONE_WAY).await;
        answer
    }
}

struct InMemory {
    store: MemoryStore,
}

impl ContractBackend for InMemory {
    async fn new_process(&self, options: LockOptions) -> DistributedLock {
        DistributedLock::builder(RoundTrip::new(&self.store))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_lease_is_released_exactly_once() {
    let store = MemoryStore::new();
    lockingkit::testing::each_lease_is_released_exactly_once(|| RoundTrip::new(&store), LEASE)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_or_late_release_never_frees_the_next_holder() {
    let store = MemoryStore::new();
    lockingkit::testing::a_repeated_or_late_release_never_frees_the_next_holder(|| {
        RoundTrip::new(&store)
    })
    .await;
}
