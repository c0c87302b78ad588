//! The release cases of the contract suite that need the backend itself (see
//! `lockingkit::testing`), against real PostgreSQL and Azurite: every lease the engine wins is
//! released at the backend exactly once, and a repeated or late release never frees the next
//! holder's lock. The in-memory run is in `lockingkit/tests/contract_memory.rs`.

use std::time::Duration;

use lockingkit::testing::{
    a_repeated_or_late_release_never_frees_the_next_holder, each_lease_is_released_exactly_once,
};
use lockingkit::{AzureBlobBackend, AzureBlobOptions, PostgresBackend};
use lockingkit_tests::azurite::Azurite;
use lockingkit_tests::postgres::PostgresServer;

/// The check interval of the PostgreSQL contract run (`tests/postgres.rs`).
const CHECK: Duration = Duration::from_millis(500);

/// The shortest lease Azure grants, as in the Azurite contract run (`tests/azure.rs`).
const LEASE: Duration = Duration::from_secs(15);

fn postgres(server: &PostgresServer) -> PostgresBackend {
    PostgresBackend::new(server.options(CHECK)).expect("valid PostgreSQL options")
}

fn azure(azurite: &Azurite) -> AzureBlobBackend {
    AzureBlobBackend::new(
        AzureBlobOptions::from_connection_string(azurite.connection_string())
            .with_lease_duration(LEASE)
            .with_request_timeout(Duration::from_secs(2)),
    )
    .expect("valid Azure options")
}

// Each check takes keys of its own, so one server serves both.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_releases_each_lease_once_and_never_frees_the_next_holder() {
    let server = PostgresServer::start().await;
    each_lease_is_released_exactly_once(|| postgres(&server), CHECK).await;
    a_repeated_or_late_release_never_frees_the_next_holder(|| postgres(&server)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn azure_releases_each_lease_once_and_never_frees_the_next_holder() {
    let azurite = Azurite::start().await;
    each_lease_is_released_exactly_once(|| azure(&azurite), LEASE).await;
    a_repeated_or_late_release_never_frees_the_next_holder(|| azure(&azurite)).await;
}
