//! The contract kit's backend for a fixture server: every "process" of a contract case is an
//! engine on a backend of its own (its own connections, pool or HTTP client), made from the
//! fixture by one function.

use std::time::Duration;

use lockingkit::backend::{LeaseTiming, LockBackend};
use lockingkit::testing::ContractBackend;
use lockingkit::{DistributedLock, LockOptions};

/// A [`ContractBackend`] on `fixture`, whose processes each build a backend with `backend`.
pub struct FixtureContract<S, F> {
    fixture: S,
    lease_period: Duration,
    backend: F,
}

impl<S, F> FixtureContract<S, F> {
    /// Processes on `fixture` (kept running as long as the contract), each with a backend of
    /// its own from `backend`; `lease_period` as [`ContractBackend::lease_period`] defines it.
    pub fn new<B>(fixture: S, lease_period: Duration, backend: F) -> Self
    where
        F: Fn(&S) -> B,
    {
        FixtureContract {
            fixture,
            lease_period,
            backend,
        }
    }

    /// A new backend on the fixture, as each process gets one.
    pub fn backend<B>(&self) -> B
    where
        F: Fn(&S) -> B,
    {
        (self.backend)(&self.fixture)
    }
}

impl<S, B, F> ContractBackend for FixtureContract<S, F>
where
    S: Send + Sync,
    B: LockBackend,
    F: Fn(&S) -> B + Send + Sync,
{
    async fn new_process(&self, options: LockOptions) -> DistributedLock {
        DistributedLock::builder(self.backend())
            .options(options)
            .build()
            .expect("valid lock options")
    }

    fn lease_period(&self) -> Duration {
        self.lease_period
    }

    /// Read from a backend the fixture makes (building one sends nothing).
    fn leases_held_by_connection(&self) -> bool {
        matches!(self.backend().timing(), LeaseTiming::ConnectionHeld(_))
    }
}
