//! The contract suite, reusable against any backend (feature `testing`).
//!
//! Every provider — the built-in ones and yours — must behave the same way. Implement
//! [`ContractBackend`] for a factory that makes separate "processes" (each a
//! [`DistributedLock`] with its own client or pool, all on one real backend), then generate the
//! suite with [`contract_tests!`](crate::contract_tests):
//!
//! ```
//! use std::time::Duration;
//! use lockingkit::testing::ContractBackend;
//! use lockingkit::{DistributedLock, LockOptions, MemoryBackend, MemoryStore};
//!
//! /// Your backend's test server; here the in-memory store stands in for it.
//! struct MyBackendContract {
//!     server: MemoryStore,
//! }
//!
//! impl ContractBackend for MyBackendContract {
//!     async fn new_process(&self, options: LockOptions) -> DistributedLock {
//!         // Each "process" gets a client of its own on the shared server.
//!         let backend = MemoryBackend::with_lease(self.server.clone(), self.lease_period());
//!         DistributedLock::builder(backend)
//!             .options(options)
//!             .build()
//!             .expect("valid options")
//!     }
//!
//!     fn lease_period(&self) -> Duration {
//!         Duration::from_secs(1)
//!     }
//! }
//!
//! lockingkit::contract_tests!(async {
//!     MyBackendContract {
//!         server: MemoryStore::new(),
//!     }
//! });
//! # fn main() {}
//! ```
//!
//! The cases run in real time against the real backend; they panic with a description when the
//! backend breaks the contract, like any test assertion.
//!
//! Two more cases need the backend itself, not only a `DistributedLock`, and take a function
//! that makes one "process"'s backend:
//! [`each_lease_is_released_exactly_once`] counts releases at the backend through a
//! [`CountingBackend`], and [`a_repeated_or_late_release_never_frees_the_next_holder`] sends
//! releases directly. Call them from your own tests:
//!
//! ```
//! # use std::time::Duration;
//! # use lockingkit::{MemoryBackend, MemoryStore};
//! #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
//! async fn each_lease_is_released_exactly_once() {
//!     let server = MemoryStore::new(); // your backend's test server
//!     let lease = Duration::from_secs(1);
//!     lockingkit::testing::each_lease_is_released_exactly_once(
//!         || MemoryBackend::with_lease(server.clone(), lease),
//!         lease,
//!     )
//!     .await;
//! }
//! # fn main() {}
//! ```

mod cases;
mod counting;
mod election;
mod intercept;
mod intervals;
mod multi_key;
mod release;
mod waits;

use std::future::Future;
use std::time::Duration;

pub use cases::*;
pub use counting::{CountedLease, CountingBackend};
pub use election::*;
pub use intercept::{Call, Intercept};
pub use intervals::{HeldInterval, IntervalChecker};
pub use multi_key::*;
pub use release::{
    a_repeated_or_late_release_never_frees_the_next_holder, each_lease_is_released_exactly_once,
};
pub use waits::*;

use crate::{DistributedLock, LockOptions};

/// A factory of "processes" sharing one real backend, for the contract suite.
pub trait ContractBackend: Send + Sync {
    /// A new, independent `DistributedLock` on the shared backend, with its own client or pool,
    /// built with `options`.
    fn new_process(&self, options: LockOptions) -> impl Future<Output = DistributedLock> + Send;

    /// One lease period: the lease duration of an expiring backend, or the check interval of a
    /// connection-held one. The renewal case holds a lock for more than three of these, and a
    /// process whose holder is gone must have given the key back within a quarter of one on an
    /// expiring backend (a leaked lease would free the key only when it expires).
    fn lease_period(&self) -> Duration;

    /// Whether the backend's leases live as long as a connection
    /// ([`LeaseTiming::ConnectionHeld`](crate::backend::LeaseTiming::ConnectionHeld)): a lease
    /// such a backend leaked is never freed, so a process is given 5 s, not a quarter of a
    /// check interval, to give a key back, which only a hang exceeds. `false` unless overridden.
    fn leases_held_by_connection(&self) -> bool {
        false
    }
}

/// Options that poll quickly, so contention cases finish in seconds.
pub fn quick_polling() -> LockOptions {
    LockOptions {
        min_retry_delay: Duration::from_millis(10),
        max_retry_delay: Duration::from_millis(100),
        ..LockOptions::default()
    }
}

/// Polls `work` up to `polls` times, yielding to the runtime in between, and drops it if it has
/// not finished: a caller that goes away at a chosen point of its attempt. A wall-clock cut
/// alone is not enough, because tokio's timers count whole milliseconds and a backend on
/// loopback answers sooner, so no attempt would ever be abandoned in flight.
async fn abandon_after_polls<F: Future>(work: F, polls: usize) -> Option<F::Output> {
    use std::task::Poll;
    let mut work = std::pin::pin!(work);
    for _ in 0..polls {
        let polled = std::future::poll_fn(|cx| Poll::Ready(work.as_mut().poll(cx))).await;
        if let Poll::Ready(output) = polled {
            return Some(output);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// A key prefix unique to this run, so repeated runs against one server do not meet.
pub fn unique_prefix(case: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("contract/{case}/{:016x}", hasher.finish())
}

/// Generates one `#[tokio::test]` per contract case for a backend.
///
/// `$setup` is an expression yielding a future of a [`ContractBackend`]; it runs once per test.
/// The calling crate needs `tokio` with the `macros` and `rt-multi-thread` features.
///
/// A provider without reader-writer locks or without semaphores declares it, and the suite
/// runs exactly the cases that apply: `contract_tests!(setup, without: [readers])` (or
/// `[semaphores]`, or both). In place of each case that does not apply it generates
/// `<case>::not_applicable`, which checks that the provider refuses that kind of lock as
/// `Misconfigured` and that its `supports` says so, so the test output names every case that
/// was not applicable. A declared kind the provider refuses fails its cases.
#[macro_export]
macro_rules! contract_tests {
    ($setup:expr $(,)?) => {
        $crate::contract_tests!($setup, without: []);
    };
    ($setup:expr, without: [$($without:ident),* $(,)?] $(,)?) => {
        $( $crate::contract_tests!(@known $without); )*
        $crate::contract_tests!(@cases $setup;
            busy_and_not_reentrant,
            release_lets_the_next_holder_in_at_once,
            release_is_idempotent_and_drop_releases,
            waiting_and_timeouts,
            eighty_acquisitions_by_twenty_contenders_in_four_processes_never_overlap,
            look_alike_keys_never_share_a_lock,
            cancellation_before_during_and_after_an_attempt_leaks_nothing,
            renewal_keeps_the_lock_over_three_lease_periods,
            fencing_tokens_grow,
            local_waiters_are_served_in_arrival_order,
            one_leader_at_a_time_among_campaigners_in_three_processes,
            leadership_passes_on_resign_within_the_bound,
            multi_key_holds_in_opposite_orders_never_deadlock,
            multi_key_holds_are_all_or_nothing,
            multi_key_cancellation_leaks_nothing,
            a_try_right_after_a_wait_ends_finds_the_key_free,
        );
        $crate::contract_tests!(@kind readers [$($without)*] $setup;
            a_provider_without_readers_refuses_them;
            readers_hold_together_and_a_writer_holds_alone,
            a_writer_waiting_behind_overlapping_readers_gets_in,
            a_try_right_after_a_reader_or_writer_wait_ends_finds_the_key_free,
            hand_offs_to_readers_and_writers_leave_the_key_free_for_others,
        );
        $crate::contract_tests!(@kind semaphores [$($without)*] $setup;
            a_provider_without_semaphores_refuses_them;
            a_semaphore_never_has_more_than_its_count_of_holders,
            a_semaphore_of_one_hands_out_growing_tokens,
            shared_holds_leak_nothing_and_stay_renewed,
            a_try_right_after_a_semaphore_wait_ends_finds_a_slot_free,
        );
    };
    (@known readers) => {};
    (@known semaphores) => {};
    (@known $other:ident) => {
        compile_error!(concat!(
            "contract_tests!: `",
            stringify!($other),
            "` is not a kind of lock; `without:` takes `readers` and `semaphores`"
        ));
    };
    // The kind was declared missing: each of its cases becomes its refusal check.
    (@kind readers [readers $($rest:ident)*] $setup:expr; $refusal:ident; $($case:ident),+ $(,)?) => {
        $crate::contract_tests!(@not_applicable $setup; $refusal; $($case),+);
    };
    (@kind semaphores [semaphores $($rest:ident)*] $setup:expr; $refusal:ident; $($case:ident),+ $(,)?) => {
        $crate::contract_tests!(@not_applicable $setup; $refusal; $($case),+);
    };
    (@kind $kind:ident [$other:ident $($rest:ident)*] $setup:expr; $refusal:ident; $($case:ident),+ $(,)?) => {
        $crate::contract_tests!(@kind $kind [$($rest)*] $setup; $refusal; $($case),+);
    };
    (@kind $kind:ident [] $setup:expr; $refusal:ident; $($case:ident),+ $(,)?) => {
        $crate::contract_tests!(@cases $setup; $($case),+);
    };
    (@not_applicable $setup:expr; $refusal:ident; $($case:ident),+) => {
        $(
            #[allow(non_snake_case)]
            mod $case {
                #[allow(unused_imports)]
                use super::*;

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn not_applicable() {
                    let backend = $setup.await;
                    $crate::testing::$refusal(&backend).await;
                }
            }
        )+
    };
    (@cases $setup:expr; $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let backend = $setup.await;
                $crate::testing::$case(&backend).await;
            }
        )+
    };
}
