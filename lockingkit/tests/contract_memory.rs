//! The contract suite against the in-memory provider: four "processes" share one store.
//!
//! Built only with the `testing` feature (`required-features` in Cargo.toml), so a run without
//! it leaves this suite out by name instead of running an empty binary.

use std::time::Duration;

use lockingkit::backend::BackendError;
use lockingkit::testing::{Call, ContractBackend, Intercept};
use lockingkit::{DistributedLock, LockOptions, MemoryBackend, MemoryStore};

/// Short leases so the renewal case covers three lease periods in a few seconds.
const LEASE: Duration = Duration::from_millis(600);

/// How long each request takes to reach the store, and its answer to come back.
const ONE_WAY: Duration = Duration::from_millis(1);

/// A call sent over the simulated network: `ONE_WAY` there, and `ONE_WAY` back.
async fn round_trip<T>(call: Call<'_, T>) -> Result<T, BackendError> {
    tokio::time::sleep(ONE_WAY).await;
    let answer = call.await;
    tokio::time::sleep(ONE_WAY).await;
    answer
}

/// The in-memory backend behind a simulated network. The store answers within a single poll,
/// so without this a caller could never go away while its attempt is in flight, and the
/// cancellation cases would not exercise the release of a lease won by an abandoned attempt.
fn round_trip_backend(store: &MemoryStore) -> Intercept<MemoryBackend> {
    Intercept::new(MemoryBackend::with_lease(store.clone(), LEASE))
        .on_try_acquire(|attempt| Box::pin(round_trip(attempt)))
        .on_renew(|renewal| Box::pin(round_trip(renewal)))
        .on_release(|release| Box::pin(round_trip(release)))
}

struct InMemory {
    store: MemoryStore,
}

impl ContractBackend for InMemory {
    async fn new_process(&self, options: LockOptions) -> DistributedLock {
        DistributedLock::builder(round_trip_backend(&self.store))
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
    lockingkit::testing::each_lease_is_released_exactly_once(|| round_trip_backend(&store), LEASE)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_or_late_release_never_frees_the_next_holder() {
    let store = MemoryStore::new();
    lockingkit::testing::a_repeated_or_late_release_never_frees_the_next_holder(|| {
        round_trip_backend(&store)
    })
    .await;
}
