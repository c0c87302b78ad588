//! The etcd provider against real clusters: the contract suite on one member and on three,
//! first come first served across processes, queue places that leave nothing behind, the key
//! layout as plain etcd clients see it, and configuration.
//!
//! Each test starts its own throwaway cluster (see `lockingkit_tests::etcd`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockingkit::providers::etcd::EtcdLockKeys;
use lockingkit::testing::{quick_polling, unique_prefix, ContractBackend};
use lockingkit::{DistributedLock, ErrorKind, EtcdBackend, EtcdOptions, LockOptions};
use lockingkit_tests::etcd::EtcdCluster;
use tokio::time::Instant;

/// The shortest lease the provider accepts, so renewal cases finish quickly.
const TTL: Duration = Duration::from_secs(2);

fn lock_on(options: EtcdOptions, lock_options: LockOptions) -> DistributedLock {
    let backend = EtcdBackend::new(options).expect("valid etcd options");
    DistributedLock::builder(backend)
        .options(lock_options)
        .build()
        .expect("valid lock options")
}

fn process(cluster: &EtcdCluster) -> DistributedLock {
    lock_on(cluster.options(TTL), quick_polling())
}

fn backend(lock: &DistributedLock) -> &EtcdBackend {
    lock.backend::<EtcdBackend>().expect("an etcd-backed lock")
}

/// Waits for `condition`, polling: for state only the cluster can report.
async fn eventually(what: &str, within: Duration, mut condition: impl AsyncFnMut() -> bool) {
    let give_up = Instant::now() + within;
    while !condition().await {
        assert!(Instant::now() < give_up, "{what} did not happen within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Each "process" is a `DistributedLock` with its own etcd client, lease and watch stream.
struct EtcdContract {
    cluster: EtcdCluster,
}

impl ContractBackend for EtcdContract {
    async fn new_process(&self, options: LockOptions) -> DistributedLock {
        lock_on(self.cluster.options(TTL), options)
    }

    fn lease_period(&self) -> Duration {
        TTL
    }
}

mod single_member {
    use super::*;

    lockingkit::contract_tests!(async {
        EtcdContract {
            cluster: EtcdCluster::single().await,
        }
    });
}

mod three_members {
    use super::*;

    lockingkit::contract_tests!(async {
        EtcdContract {
            cluster: EtcdCluster::three().await,
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_lease_is_released_exactly_once() {
    let cluster = EtcdCluster::single().await;
    let options = cluster.options(TTL);
    lockingkit::testing::each_lease_is_released_exactly_once(
        || EtcdBackend::new(options.clone()).expect("options"),
        TTL,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_or_late_release_never_frees_the_next_holder() {
    let cluster = EtcdCluster::single().await;
    let options = cluster.options(TTL);
    lockingkit::testing::a_repeated_or_late_release_never_frees_the_next_holder(|| {
        EtcdBackend::new(options.clone()).expect("options")
    })
    .await;
}
