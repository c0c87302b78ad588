//! The Azure Blob lease provider against a real Azurite: the contract suite, interop with plain
//! SDK clients, fenced writes, error mapping and guard-blob hygiene.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use azure_core::http::RequestContent;
use azure_storage_blob::models::{
    BlobClientAcquireLeaseOptions, BlobClientAcquireLeaseResultHeaders,
    BlobClientBreakLeaseOptions, BlobClientGetPropertiesResultHeaders, BlobClientUploadOptions,
};
use azure_storage_blob::BlobClient;
use lockingkit::keys::AzureLockKeys;
use lockingkit::providers::azure::{
    AzureBlobBackend, AzureBlobOptions, AzureRequestError, FENCING_TOKEN_METADATA,
};
use lockingkit::{DistributedLock, ErrorKind, LockError, LossReason};
use lockingkit_tests::azurite::{Azurite, Persistence};
use lockingkit_tests::checks::{
    assert_mentions, assert_semaphore_full, assert_token_grew, release_once_won,
};
use lockingkit_tests::field_log::FieldLog;

/// The shortest lease Azure grants, so renewal and loss cases finish soonest.
const LEASE: Duration = Duration::from_secs(15);

fn options(azurite: &Azurite) -> AzureBlobOptions {
    AzureBlobOptions::from_connection_string(azurite.connection_string())
        .with_lease_duration(LEASE)
        .with_request_timeout(Duration::from_secs(2))
}

fn lock_with(options: AzureBlobOptions) -> DistributedLock {
    let backend = AzureBlobBackend::new(options).expect("valid Azure options");
    DistributedLock::builder(backend)
        .options(lockingkit::testing::quick_polling())
        .build()
        .expect("valid lock options")
}

fn unique(case: &str) -> String {
    lockingkit::testing::unique_prefix(case)
}

fn plain_guard(azurite: &Azurite, key: &str) -> BlobClient {
    azurite
        .plain_container_client("locks")
        .blob_client(&AzureLockKeys::guard_blob_name(key))
}

fn request_error(error: &LockError) -> Option<&AzureRequestError> {
    std::error::Error::source(error).and_then(|s| s.downcast_ref::<AzureRequestError>())
}

fn status_of(error: &azure_core::Error) -> Option<u16> {
    error.http_status().map(u16::from)
}

mod contract {
    use super::*;
    use lockingkit_tests::contract::FixtureContract;

    /// Each "process" is its own backend: its own HTTP client, pipeline and token memory.
    fn backend(azurite: &Azurite) -> AzureBlobBackend {
        AzureBlobBackend::new(super::options(azurite)).expect("valid Azure options")
    }

    // Blob leases have no shared mode: the reader-writer cases check the refusal instead.
    lockingkit::contract_tests!(
        async {
            FixtureContract::new(Azurite::start().await, LEASE, backend)
        },
        without: [readers]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_taken_by_a_plain_sdk_client_makes_the_lock_busy_until_released() {
    let azurite = Azurite::start().await;
    let locks = lock_with(options(&azurite));
    let key = unique("interop");
    let guard = plain_guard(&azurite, &key);
    guard
        .upload(
            RequestContent::from(Vec::new()),
            Some(BlobClientUploadOptions::default()),
        )
        .await
        .expect("plain upload of the guard");
    let lease = guard
        .acquire_lease(15, None)
        .await
        .expect("plain acquire")
        .lease_id()
        .expect("lease id header")
        .expect("a lease id");

    let busy = locks.try_acquire(&key).await.unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::Busy, "{busy}");
    let timeout = locks
        .acquire(&key, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert_eq!(timeout.kind(), ErrorKind::Timeout, "{timeout}");

    guard
        .release_lease(lease, None)
        .await
        .expect("plain release");
    let handle = locks
        .try_acquire(&key)
        .await
        .expect("free after the plain release");
    assert!(handle.is_held());
    handle.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_gets_the_lock_when_the_plain_client_releases() {
    let azurite = Azurite::start().await;
    let locks = lock_with(options(&azurite));
    let key = unique("interop-wait");
    let guard = plain_guard(&azurite, &key);
    guard
        .upload(RequestContent::from(Vec::new()), None)
        .await
        .expect("plain upload");
    let lease = guard
        .acquire_lease(15, None)
        .await
        .expect("plain acquire")
        .lease_id()
        .expect("lease id header")
        .expect("a lease id");
    let waiter = {
        let locks = locks.clone();
        let key = key.clone();
        tokio::spawn(async move { locks.acquire(&key, Duration::from_secs(10)).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await; // let the waiter meet the busy lease
    assert!(
        !waiter.is_finished(),
        "the waiter got a lock the plain client holds"
    );
    guard
        .release_lease(lease, None)
        .await
        .expect("plain release");
    release_once_won(waiter, "after the plain release").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_write_succeeds_while_held_and_is_refused_after_the_lease_is_broken() {
    let azurite = Azurite::start().await;
    let locks = lock_with(options(&azurite));
    let key = unique("fenced");
    let handle = locks.try_acquire(&key).await.expect("acquire");
    let lease = handle.azure_blob_lease().expect("an Azure lease");
    assert_eq!(lease.fencing_token(), handle.fencing_token());
    let shown = format!("{lease:?} {handle:?}");
    assert!(
        !shown.contains(lease.lease_id()) && !shown.contains("fenced"),
        "{shown}"
    );

    lease
        .blob_client()
        .upload(
            RequestContent::from(b"written under the lock".to_vec()),
            Some(lease.upload_options()),
        )
        .await
        .expect("a fenced write while held");
    // Without the lease id the same write is refused: the lease is what fences.
    let unfenced = plain_guard(&azurite, &key)
        .upload(RequestContent::from(b"intruder".to_vec()), None)
        .await
        .unwrap_err();
    assert_eq!(status_of(&unfenced), Some(412), "{unfenced}");

    plain_guard(&azurite, &key)
        .break_lease(Some(BlobClientBreakLeaseOptions {
            break_period: Some(0),
            ..Default::default()
        }))
        .await
        .expect("plain break");
    let late = lease
        .blob_client()
        .upload(
            RequestContent::from(b"late write".to_vec()),
            Some(lease.upload_options()),
        )
        .await
        .unwrap_err();
    assert_eq!(status_of(&late), Some(412), "{late}");

    // The next renewal (every 5 s) is told the lease is broken: loss at once, not at the deadline.
    let lost = handle.lost_token();
    tokio::time::timeout(LEASE, lost.cancelled())
        .await
        .expect("loss declared after the break");
    assert_eq!(handle.loss_reason(), Some(LossReason::LeaseGone));
    assert_eq!(handle.ensure_held().unwrap_err().kind(), ErrorKind::Lost);

    // The fenced upload kept the token entry, so the next holder's token is still higher.
    // The engine frees the key locally once its loss handling is over: wait for that.
    let next = locks
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("acquire after the break");
    assert!(next.fencing_token() > lease.fencing_token());
    next.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_guard_content_and_metadata_are_left_alone() {
    let azurite = Azurite::start().await;
    let locks = lock_with(options(&azurite));
    let key = unique("hygiene");
    let guard = plain_guard(&azurite, &key);
    let owner = HashMap::from([("owner".to_owned(), "ops-team".to_owned())]);
    guard
        .upload(
            RequestContent::from(b"operator notes".to_vec()),
            Some(BlobClientUploadOptions {
                metadata: Some(owner),
                ..Default::default()
            }),
        )
        .await
        .expect("plain upload");

    for expected_token in 1..=2u64 {
        let handle = locks.try_acquire(&key).await.expect("acquire");
        assert_eq!(handle.fencing_token(), expected_token);
        handle.release().await.expect("release");
    }

    let properties = guard.get_properties(None).await.expect("properties");
    let metadata = properties.metadata().expect("metadata");
    assert_eq!(metadata.get("owner").map(String::as_str), Some("ops-team"));
    assert_eq!(
        metadata.get(FENCING_TOKEN_METADATA).map(String::as_str),
        Some("2")
    );
    assert_eq!(metadata.len(), 2, "{metadata:?}");
    let content = guard
        .download(None)
        .await
        .expect("download")
        .body
        .collect()
        .await
        .expect("content");
    assert_eq!(&content[..], b"operator notes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_guard_is_created_empty_on_first_use() {
    let azurite = Azurite::start().await;
    let locks = lock_with(options(&azurite));
    let key = unique("created/ключ");
    let guard = plain_guard(&azurite, &key);
    assert!(!guard.exists().await.expect("exists"));
    let handle = locks.try_acquire(&key).await.expect("acquire");
    assert_eq!(handle.fencing_token(), 1);
    let properties = guard.get_properties(None).await.expect("the guard exists");
    assert_eq!(properties.content_length().expect("length"), Some(0));
    handle.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_token_is_never_reused_after_another_process_wrote() {
    let azurite = Azurite::start().await;
    let first = lock_with(options(&azurite));
    let second = lock_with(options(&azurite));
    let key = unique("memory");
    let mut last = 0;
    // first, first (its own memory is current), second, first (its memory is stale), …
    for lock in [&first, &first, &second, &first, &second, &second, &first] {
        let handle = lock.try_acquire(&key).await.expect("acquire");
        assert_eq!(handle.fencing_token(), last + 1);
        last = handle.fencing_token();
        handle.release().await.expect("release");
    }
    // A write by someone else under a plain lease changes the blob: still no reuse.
    let guard = plain_guard(&azurite, &key);
    let lease = guard
        .acquire_lease(15, None)
        .await
        .expect("plain acquire")
        .lease_id()
        .expect("header")
        .expect("lease id");
    let mut metadata = guard
        .get_properties(None)
        .await
        .expect("properties")
        .metadata()
        .expect("metadata");
    metadata.insert("touched".into(), "yes".into());
    guard
        .set_metadata(
            &metadata,
            Some(azure_storage_blob::models::BlobClientSetMetadataOptions {
                lease_id: Some(lease.clone()),
                ..Default::default()
            }),
        )
        .await
        .expect("plain metadata write");
    guard
        .release_lease(lease, None)
        .await
        .expect("plain release");
    let handle = first.try_acquire(&key).await.expect("acquire");
    assert_eq!(handle.fencing_token(), last + 1);
    handle.release().await.expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_acquire_with_the_same_proposed_lease_id_is_granted_again() {
    // What makes the SDK's retry of a lost acquire answer safe: the service grants the same
    // proposed id twice instead of answering 409.
    let azurite = Azurite::start().await;
    let guard = plain_guard(&azurite, &unique("proposed"));
    guard
        .upload(RequestContent::from(Vec::new()), None)
        .await
        .expect("plain upload");
    let id = "0f8fad5b-d9cb-469f-a165-70867728950e".to_owned();
    for _ in 0..2 {
        let granted = guard
            .acquire_lease(
                15,
                Some(BlobClientAcquireLeaseOptions {
                    proposed_lease_id: Some(id.clone()),
                    ..Default::default()
                }),
            )
            .await
            .expect("acquire with the proposed id");
        assert_eq!(
            granted.lease_id().expect("header").as_deref(),
            Some(id.as_str())
        );
    }
    let other = guard.acquire_lease(15, None).await.unwrap_err();
    assert_eq!(status_of(&other), Some(409));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_account_key_is_misconfigured_because_azurite_checks_the_signature() {
    let azurite = Azurite::start().await;
    let wrong =
        AzureBlobOptions::from_connection_string(azurite.connection_string_with_wrong_key())
            .with_lease_duration(LEASE);
    let locks = lock_with(wrong);
    let error = locks.try_acquire(&unique("wrong-key")).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert_eq!(
        request_error(&error).and_then(AzureRequestError::status),
        Some(403)
    );
    // The right key, same everything else, is accepted: the signature is what was judged.
    let right = lock_with(options(&azurite));
    right
        .try_acquire(&unique("right-key"))
        .await
        .expect("acquire with the right key")
        .release()
        .await
        .expect("release");
    // A waiter stops at the first misconfiguration instead of waiting out its timeout.
    let started = Instant::now();
    let error = locks
        .acquire(&unique("wrong-key"), Duration::from_secs(20))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_container_is_misconfigured() {
    let azurite = Azurite::start().await;
    let locks = lock_with(options(&azurite).with_container("no-such-container"));
    let error = locks.try_acquire(&unique("container")).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert_eq!(
        request_error(&error).and_then(AzureRequestError::error_code),
        Some("ContainerNotFound")
    );
    assert!(
        error
            .message()
            .contains("the container `no-such-container` does not exist"),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_a_missing_container_at_startup_and_ensure_container_creates_it() {
    let azurite = Azurite::start().await;
    let backend = AzureBlobBackend::new(options(&azurite).with_container("fresh-locks"))
        .expect("valid Azure options");
    let error = backend.verify().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert!(
        error
            .message()
            .contains("the container `fresh-locks` does not exist"),
        "{error}"
    );

    // The development opt-in creates it; a second call finds it there.
    backend
        .ensure_container()
        .await
        .expect("create the container");
    backend
        .ensure_container()
        .await
        .expect("an existing container is fine");
    backend.verify().await.expect("the container exists now");
    let locks = DistributedLock::builder(backend)
        .build()
        .expect("valid lock options");
    locks
        .try_acquire(&unique("fresh"))
        .await
        .expect("acquire in the new container")
        .release()
        .await
        .expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_verifies_every_azure_provider_in_one_error() {
    let azurite = Azurite::start().await;
    let section = |container: &str| {
        serde_json::json!({
            "provider": "azure_blob",
            "connection_string": azurite.connection_string(),
            "container": container,
            "lease_duration": "15s",
            "request_timeout": "2s",
        })
    };
    let config = lockingkit::LockingConfig::new()
        .with_section("Default", section("locks"))
        .with_section("Jobs", section("job-locks"))
        .with_section("Reports", section("report-locks"))
        .with_section("Scratch", serde_json::json!({"provider": "in_memory"}));
    let locking = lockingkit::Locking::from_config(config).expect("valid configuration");
    let error = locking.verify().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    let shown = error.to_string();
    assert_mentions(
        &shown,
        &[
            "Locking.Jobs: the container `job-locks` does not exist",
            "Locking.Reports: the container `report-locks` does not exist",
        ],
    );
    assert!(!shown.contains("Locking.Default"), "{shown}");

    azurite.create_container("job-locks").await;
    azurite.create_container("report-locks").await;
    locking.verify().await.expect("every container exists now");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_account_name_is_misconfigured_and_says_what_to_check() {
    let azurite = Azurite::start_local(Persistence::InMemory).await;
    // The account renamed everywhere, as when the name is mistyped: Azurite has no such
    // account and answers 404 ResourceNotFound.
    let wrong = azurite
        .connection_string()
        .replace("devstoreaccount1", "devstoreaccount2");
    let backend = AzureBlobBackend::new(
        AzureBlobOptions::from_connection_string(wrong)
            .with_lease_duration(LEASE)
            .with_request_timeout(Duration::from_secs(2)),
    )
    .expect("valid Azure options");
    let error = backend.verify().await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert!(error.message().contains("AccountName"), "{error}");

    let locks = DistributedLock::builder(backend)
        .build()
        .expect("valid lock options");
    let error = locks.try_acquire(&unique("account")).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
    assert!(
        error.message().contains("no such account at this endpoint"),
        "{error}"
    );
    assert_eq!(
        request_error(&error).and_then(AzureRequestError::status),
        Some(404)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_is_unavailable_not_a_timeout() {
    let mut azurite = Azurite::start_local(Persistence::InMemory).await;
    let locks = lock_with(options(&azurite));
    azurite.kill();
    let error = locks.try_acquire(&unique("stopped")).await.unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    let error = locks
        .acquire(&unique("stopped"), Duration::from_secs(1))
        .await
        .unwrap_err();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_server_fails_a_call_within_the_request_timeout() {
    let mut azurite = Azurite::start_local(Persistence::InMemory).await;
    let timeout = Duration::from_secs(1);
    let locks = lock_with(options(&azurite).with_request_timeout(timeout));
    // A first call opens a pooled connection, so the hung call below is a read that never ends.
    locks
        .try_acquire(&unique("warm"))
        .await
        .expect("acquire")
        .release()
        .await
        .expect("release");
    azurite.pause();
    let started = Instant::now();
    let error = locks.try_acquire(&unique("hung")).await.unwrap_err();
    let took = started.elapsed();
    azurite.resume();
    assert_eq!(error.kind(), ErrorKind::Unavailable, "{error}");
    // The SDK's defaults would take about two minutes here.
    assert!(
        took >= timeout && took < timeout * 3,
        "a hung call took {took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fixture_restarts_on_the_same_port_and_keeps_blobs_on_disk() {
    let mut azurite = Azurite::start_local(Persistence::OnDisk).await;
    let port = azurite.port();
    let locks = lock_with(options(&azurite));
    let key = unique("restart");
    let first = locks.try_acquire(&key).await.expect("acquire");
    let token = first.fencing_token();
    first.release().await.expect("release");
    azurite.restart().await;
    assert_eq!(azurite.port(), port);
    let again = locks
        .try_acquire(&key)
        .await
        .expect("acquire after restart");
    assert_token_grew(again, token, "an on-disk restart").await;
}

#[tokio::test]
async fn locks_of_other_providers_have_no_azure_lease() {
    let locks = DistributedLock::in_memory();
    let handle = locks.try_acquire("orders/42").await.expect("acquire");
    assert!(handle.azure_blob_lease().is_none());
    handle.release().await.expect("release");
}

// On the current thread: the capturing subscriber is this thread's default, and every SDK call
// (and its logging) runs here.
#[tokio::test]
async fn the_sdks_request_logs_never_show_a_key_or_its_guard_blob() {
    use tracing_subscriber::layer::SubscriberExt;

    let mut azurite = Azurite::start_local(Persistence::InMemory).await;
    let logged = FieldLog::default();
    // Only LockingKit's calls are captured, not the test's own plain-client checks.
    let capture =
        || tracing::subscriber::set_default(tracing_subscriber::registry().with(logged.clone()));
    let capturing = capture();

    let key = unique("customer-4711/invoice");
    let holder = lock_with(options(&azurite));
    let other = lock_with(options(&azurite));
    let handle = holder.try_acquire(&key).await.expect("acquire");
    // A busy attempt (409) and a renewal-free release, each logged by the SDK.
    let busy = other.try_acquire(&key).await.unwrap_err();
    assert_eq!(busy.kind(), ErrorKind::Busy);
    handle.release().await.expect("release");
    let again = other.try_acquire(&key).await.expect("free again");
    again.release().await.expect("release");
    drop(capturing);
    let guard_exists = plain_guard(&azurite, &key).exists().await.expect("exists");
    let placeholder_exists = azurite
        .plain_container_client("locks")
        .blob_client("lockingkit-guard")
        .exists()
        .await
        .expect("exists");
    // Failed requests are logged at info level, with their error.
    azurite.kill();
    {
        let _capturing = capture();
        let down = holder.try_acquire(&key).await.unwrap_err();
        assert_eq!(down.kind(), ErrorKind::Unavailable);
    }

    let logged = logged.text();
    assert!(
        logged.contains("lockingkit-guard"),
        "the SDK's request log lines were captured: {logged}"
    );
    assert!(
        logged.contains("Failed response"),
        "the failed requests were logged too: {logged}"
    );
    let name = AzureLockKeys::guard_blob_name(&key);
    for secret in [
        "customer-4711".to_owned(),
        name.clone(),
        name.replace('/', "%2F"),
    ] {
        assert!(
            !logged.contains(&secret),
            "{secret:?} reached the logs:\n{logged}"
        );
    }
    // The requests went to the real guard, never to a blob named like the placeholder.
    assert!(guard_exists);
    assert!(!placeholder_exists);
}

/// Semaphores at the backend level, through [`LockBackend::try_acquire`] as the engine calls
/// it: every holder is one lease on one slot blob.
mod semaphore {
    use super::*;
    use azure_storage_blob::models::LeaseState;
    use lockingkit::backend::LockBackend;
    use lockingkit::providers::azure::{AzureBlobLease, MAX_SEMAPHORE_SLOTS};
    use lockingkit::LockMode;
    use lockingkit_tests::proxy::FaultProxy;

    const THREE: LockMode = LockMode::Semaphore { max_count: 3 };

    fn backend(azurite: &Azurite) -> AzureBlobBackend {
        AzureBlobBackend::new(options(azurite)).expect("valid Azure options")
    }

    /// One attempt at a slot of `key`; `None` when every slot is taken.
    async fn try_slot(
        backend: &AzureBlobBackend,
        key: &str,
        mode: LockMode,
    ) -> Option<AzureBlobLease> {
        backend
            .try_acquire(key, mode)
            .await
            .unwrap_or_else(|e| panic!("a semaphore attempt failed: {e}"))
            .map(|acquired| {
                assert_eq!(acquired.fencing_token, acquired.lease.fencing_token());
                acquired.lease
            })
    }

    fn slot_of(lease: &AzureBlobLease) -> u32 {
        lease
            .semaphore_slot()
            .expect("a semaphore lease names its slot")
    }

    /// Which of the semaphore's first `slots` slot blobs are leased right now, asked through a
    /// plain SDK client.
    async fn leased_slots(azurite: &Azurite, key: &str, slots: u32) -> Vec<u32> {
        let container = azurite.plain_container_client("locks");
        let mut leased = Vec::new();
        for slot in 0..slots {
            let blob = container.blob_client(&AzureLockKeys::semaphore_slot_blob_name(key, slot));
            match blob.get_properties(None).await {
                Ok(properties) => {
                    if properties.lease_state().expect("lease state header")
                        == Some(LeaseState::Leased)
                    {
                        leased.push(slot);
                    }
                }
                Err(e) if status_of(&e) == Some(404) => {}
                Err(e) => panic!("slot properties: {e}"),
            }
        }
        leased
    }

    /// The fencing token kept in a slot blob's metadata, read through a plain SDK client.
    async fn slot_token(azurite: &Azurite, key: &str, slot: u32) -> Option<String> {
        azurite
            .plain_container_client("locks")
            .blob_client(&AzureLockKeys::semaphore_slot_blob_name(key, slot))
            .get_properties(None)
            .await
            .expect("slot properties")
            .metadata()
            .expect("metadata")
            .get(FENCING_TOKEN_METADATA)
            .cloned()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn three_holders_across_backends_take_three_slots_and_a_fourth_is_busy() {
        let azurite = Azurite::start().await;
        let key = unique("semaphore/three");
        let backends: Vec<_> = (0..4).map(|_| backend(&azurite)).collect();
        let mut held = Vec::new();
        for backend in &backends[..3] {
            held.push(try_slot(backend, &key, THREE).await.expect("a free slot"));
        }
        let mut slots: Vec<u32> = held.iter().map(slot_of).collect();
        slots.sort_unstable();
        assert_eq!(slots, [0, 1, 2]);
        assert!(
            try_slot(&backends[3], &key, THREE).await.is_none(),
            "a fourth holder got in"
        );
        // The engine may ask again while it holds a slot: its own slots are taken too.
        assert!(
            try_slot(&backends[0], &key, THREE).await.is_none(),
            "a holder got a second slot"
        );
        assert_eq!(leased_slots(&azurite, &key, 3).await, [0, 1, 2]);
        for (backend, lease) in backends.iter().zip(&held) {
            backend.release(lease).await.expect("release");
        }
        assert!(leased_slots(&azurite, &key, 3).await.is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_released_slot_lets_the_next_holder_in() {
        let azurite = Azurite::start().await;
        let key = unique("semaphore/next");
        let (holder, waiter) = (backend(&azurite), backend(&azurite));
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(try_slot(&holder, &key, THREE).await.expect("a free slot"));
        }
        assert!(try_slot(&waiter, &key, THREE).await.is_none());
        let freed = held.remove(1);
        holder.release(&freed).await.expect("release");
        let next = try_slot(&waiter, &key, THREE)
            .await
            .expect("the freed slot");
        assert_eq!(slot_of(&next), slot_of(&freed));
        assert!(next.fencing_token() > freed.fencing_token());
        assert!(try_slot(&holder, &key, THREE).await.is_none());
        waiter.release(&next).await.expect("release");
        for lease in &held {
            holder.release(lease).await.expect("release");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_attempt_never_holds_two_slots() {
        let azurite = Azurite::start().await;
        let key = unique("semaphore/one");
        let five = LockMode::Semaphore { max_count: 5 };
        let backends: Vec<_> = (0..2).map(|_| backend(&azurite)).collect();
        let mut held = Vec::new();
        // Attempts from two processes, alternating: after each, exactly one more slot is
        // leased, and it is the one the attempt reported.
        for attempt in 0..5 {
            let backend = &backends[attempt % 2];
            let lease = try_slot(backend, &key, five).await.expect("a free slot");
            held.push(slot_of(&lease));
            let mut expected = held.clone();
            expected.sort_unstable();
            assert_eq!(
                leased_slots(&azurite, &key, 5).await,
                expected,
                "after attempt {attempt}"
            );
        }
        assert!(try_slot(&backends[0], &key, five).await.is_none());
        assert_eq!(leased_slots(&azurite, &key, 5).await.len(), 5);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_semaphore_k_and_the_lock_k_do_not_interfere() {
        let azurite = Azurite::start().await;
        let key = unique("semaphore/namespace");
        let one = LockMode::Semaphore { max_count: 1 };
        let (first, second) = (backend(&azurite), backend(&azurite));
        // The lock first, then the semaphore of the same name, and both are held at once.
        let lock = first
            .try_acquire(&key, LockMode::Exclusive)
            .await
            .expect("lock")
            .expect("free lock");
        let slot = try_slot(&second, &key, one)
            .await
            .expect("the semaphore is free");
        assert_eq!(lock.fencing_token, 1);
        assert_eq!(slot.fencing_token(), 1, "the slot has a token of its own");
        // Each is busy for its own kind only.
        assert!(first
            .try_acquire(&key, LockMode::Exclusive)
            .await
            .expect("attempt")
            .is_none());
        assert!(try_slot(&first, &key, one).await.is_none());
        // The lock named like the slot's blob is yet another lock.
        let named_like_slot = format!("{key}~slot~0");
        let other = first
            .try_acquire(&named_like_slot, LockMode::Exclusive)
            .await
            .expect("lock")
            .expect("an unrelated lock is free");
        assert_ne!(
            other.lease.blob_client().url(),
            slot.blob_client().url(),
            "a lock and a slot share a blob"
        );
        // The slot's lease names its slot blob, and the lock's its guard.
        assert_eq!(
            slot.blob_client().url(),
            second.semaphore_slot_blob(&key, 0).url()
        );
        assert_eq!(lock.lease.blob_client().url(), first.guard_blob(&key).url());
        assert_eq!(lock.lease.semaphore_slot(), None);
        first.release(&lock.lease).await.expect("release");
        first.release(&other.lease).await.expect("release");
        // The semaphore is still held after the lock is gone, and the lock is free while it is.
        assert!(try_slot(&first, &key, one).await.is_none());
        let again = first
            .try_acquire(&key, LockMode::Exclusive)
            .await
            .expect("lock")
            .expect("free lock");
        assert_eq!(again.fencing_token, 2);
        first.release(&again.lease).await.expect("release");
        second.release(&slot).await.expect("release");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fencing_tokens_grow_per_slot() {
        let azurite = Azurite::start().await;
        let key = unique("semaphore/tokens");
        let two = LockMode::Semaphore { max_count: 2 };
        let (first, second) = (backend(&azurite), backend(&azurite));
        let kept = try_slot(&first, &key, two).await.expect("a free slot");
        assert_eq!(kept.fencing_token(), 1);
        // The other slot changes hands between two processes; its token grows with each holder
        // while the kept slot's stays where it was.
        for (round, backend) in [&first, &second, &second, &first].into_iter().enumerate() {
            let lease = try_slot(backend, &key, two).await.expect("the other slot");
            assert_ne!(slot_of(&lease), slot_of(&kept));
            assert_eq!(lease.fencing_token(), round as u64 + 1);
            backend.release(&lease).await.expect("release");
        }
        let kept_slot = slot_of(&kept);
        assert_eq!(
            slot_token(&azurite, &key, kept_slot).await.as_deref(),
            Some("1")
        );
        assert_eq!(
            slot_token(&azurite, &key, 1 - kept_slot).await.as_deref(),
            Some("4")
        );
        first.release(&kept).await.expect("release");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slot_lease_is_renewed_and_released_like_a_lock() {
        let azurite = Azurite::start().await;
        let key = unique("semaphore/renew");
        let (holder, other) = (backend(&azurite), backend(&azurite));
        let one = LockMode::Semaphore { max_count: 1 };
        let lease = try_slot(&holder, &key, one).await.expect("a free slot");
        holder.renew(&lease).await.expect("renew the slot's lease");
        assert!(try_slot(&other, &key, one).await.is_none());
        holder
            .release(&lease)
            .await
            .expect("release the slot's lease");
        let error = holder.renew(&lease).await.unwrap_err();
        assert_eq!(
            error.kind(),
            lockingkit::backend::BackendErrorKind::LeaseGone,
            "{error}"
        );
        let next = try_slot(&other, &key, one)
            .await
            .expect("free after release");
        other.release(&next).await.expect("release");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reader_writer_locks_are_refused_and_semaphores_have_a_limit() {
        let azurite = Azurite::start().await;
        let backend = backend(&azurite);
        assert!(!backend.supports(LockMode::Shared));
        assert!(backend.supports(LockMode::Exclusive));
        assert!(!backend.supports(LockMode::Semaphore { max_count: 0 }));
        assert!(backend.supports(LockMode::Semaphore { max_count: 1 }));
        assert!(backend.supports(LockMode::Semaphore {
            max_count: MAX_SEMAPHORE_SLOTS
        }));
        assert!(!backend.supports(LockMode::Semaphore {
            max_count: MAX_SEMAPHORE_SLOTS + 1
        }));

        let key = unique("semaphore/refused");
        let shared = backend
            .try_acquire(&key, LockMode::Shared)
            .await
            .unwrap_err();
        assert_eq!(
            shared.kind(),
            lockingkit::backend::BackendErrorKind::Misconfigured
        );
        assert!(shared.message().contains("reader-writer"), "{shared}");
        let too_many = backend
            .try_acquire(
                &key,
                LockMode::Semaphore {
                    max_count: MAX_SEMAPHORE_SLOTS + 1,
                },
            )
            .await
            .unwrap_err();
        assert_eq!(
            too_many.kind(),
            lockingkit::backend::BackendErrorKind::Misconfigured
        );
        let none = backend
            .try_acquire(&key, LockMode::Semaphore { max_count: 0 })
            .await
            .unwrap_err();
        assert_eq!(
            none.kind(),
            lockingkit::backend::BackendErrorKind::Misconfigured
        );
        // Nothing was sent: no guard and no slot blob exists.
        assert!(!plain_guard(&azurite, &key).exists().await.expect("exists"));
        assert!(leased_slots(&azurite, &key, 1).await.is_empty());
        assert!(!backend
            .semaphore_slot_blob(&key, 0)
            .exists()
            .await
            .expect("exists"));
    }

    /// Requests per attempt, counted by a proxy in front of Azurite: a full semaphore costs one
    /// request per slot; with N − 1 slots taken an attempt probes from a random slot until the
    /// free one (1 to N requests), then writes the slot's fencing token (one request, two if the
    /// slot's metadata must be read first).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_per_attempt_with_n_minus_one_slots_taken_stay_within_n_plus_two() {
        const N: u32 = 8;
        let eight = LockMode::Semaphore { max_count: N };
        let azurite = Azurite::start_local(Persistence::InMemory).await;
        let key = unique("semaphore/requests");
        let holder = backend(&azurite);
        // Every slot blob exists and all but one are taken.
        let mut held = Vec::new();
        for _ in 0..N {
            held.push(try_slot(&holder, &key, eight).await.expect("a free slot"));
        }
        let freed = held.pop().expect("a lease");
        holder.release(&freed).await.expect("release");

        let proxy = FaultProxy::to_port(azurite.port()).await;
        let through_proxy = azurite.connection_string().replace(
            &format!(":{}/", azurite.port()),
            &format!(":{}/", proxy.port()),
        );
        let counted = AzureBlobBackend::new(
            AzureBlobOptions::from_connection_string(through_proxy)
                .with_lease_duration(LEASE)
                .with_request_timeout(Duration::from_secs(2)),
        )
        .expect("valid Azure options");
        let mut counts = Vec::new();
        for _ in 0..24 {
            let before = proxy.exchanges().len();
            let lease = try_slot(&counted, &key, eight)
                .await
                .expect("the free slot");
            assert_eq!(slot_of(&lease), slot_of(&freed));
            counts.push(proxy.exchanges().len() - before);
            counted.release(&lease).await.expect("release");
        }
        let before = proxy.exchanges().len();
        let busy_holder = try_slot(&counted, &key, eight)
            .await
            .expect("the free slot");
        let filled = proxy.exchanges().len() - before;
        let before = proxy.exchanges().len();
        assert!(try_slot(&counted, &key, eight).await.is_none());
        let full = proxy.exchanges().len() - before;
        eprintln!(
            "requests per attempt, N = {N}, N - 1 taken: {counts:?} (mean {:.2}); full: {full}",
            counts.iter().sum::<usize>() as f64 / counts.len() as f64
        );
        assert_eq!(
            full, N as usize,
            "a full semaphore costs one request per slot"
        );
        // The first attempt reads the slot's metadata (two requests after the probes); later
        // ones find the slot as this process last wrote it (one request).
        assert!((3..=N as usize + 2).contains(&counts[0]), "{counts:?}");
        assert!(
            counts[1..]
                .iter()
                .all(|&c| (2..=N as usize + 1).contains(&c)),
            "{counts:?}"
        );
        assert!((2..=N as usize + 1).contains(&filled));
        // The probes start at a random slot: the counts vary.
        assert!(counts[1..].iter().any(|&c| c != counts[1]), "{counts:?}");
        counted.release(&busy_holder).await.expect("release");
        for lease in &held {
            holder.release(lease).await.expect("release");
        }
    }

    // End to end, through `DistributedLock::semaphore` and the engine.

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_semaphore_admits_three_holders_across_processes_and_a_waiter_gets_a_released_slot() {
        let azurite = Azurite::start().await;
        let key = unique("semaphore/e2e");
        let processes: Vec<_> = (0..3).map(|_| lock_with(options(&azurite))).collect();
        let semaphores: Vec<_> = processes
            .iter()
            .map(|locks| locks.semaphore(&key, 3).expect("a semaphore of three"))
            .collect();
        // Two holders in one process and one in another: each local holder has its own slot.
        let mut held = vec![
            semaphores[0].try_acquire().await.expect("a slot"),
            semaphores[0]
                .try_acquire()
                .await
                .expect("a second local slot"),
            semaphores[1].try_acquire().await.expect("a slot"),
        ];
        let mut slots: Vec<u32> = held
            .iter()
            .map(|h| slot_of(&h.azure_blob_lease().expect("an Azure lease")))
            .collect();
        slots.sort_unstable();
        assert_eq!(slots, [0, 1, 2]);
        for semaphore in &semaphores {
            let busy = semaphore.try_acquire().await.unwrap_err();
            assert_eq!(busy.kind(), ErrorKind::Busy, "{busy}");
        }
        // The lock of the same name is another lock.
        let lock = processes[2]
            .try_acquire(&key)
            .await
            .expect("the lock `key` is free");

        let waiter = {
            let semaphore = semaphores[2].clone();
            tokio::spawn(async move { semaphore.acquire(Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiter.is_finished(), "a fourth holder got in");
        let freed = held.remove(0);
        let freed_lease = freed.azure_blob_lease().expect("an Azure lease");
        freed.release().await.expect("release");
        let next = waiter
            .await
            .expect("the waiter")
            .expect("the released slot");
        let next_lease = next.azure_blob_lease().expect("an Azure lease");
        assert_eq!(slot_of(&next_lease), slot_of(&freed_lease));
        assert!(next.fencing_token() > freed_lease.fencing_token());
        assert_eq!(next.fencing_token(), next_lease.fencing_token());
        held.push(next);
        for handle in held {
            handle.release().await.expect("release");
        }
        lock.release().await.expect("release");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn semaphore_slots_are_renewed_past_their_lease() {
        let azurite = Azurite::start().await;
        let key = unique("semaphore/renewed");
        let (holder, other) = (lock_with(options(&azurite)), lock_with(options(&azurite)));
        let two = holder.semaphore(&key, 2).expect("a semaphore of two");
        let held = [
            two.try_acquire().await.expect("a slot"),
            two.try_acquire().await.expect("a slot"),
        ];
        tokio::time::sleep(LEASE + Duration::from_secs(3)).await;
        for handle in &held {
            handle.ensure_held().expect("renewed past the lease");
        }
        assert_semaphore_full(&other, &key, 2).await;
        for handle in held {
            handle.release().await.expect("release");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reader_writer_locks_are_misconfigured_on_azure_and_semaphores_end_at_the_slot_limit() {
        let azurite = Azurite::start().await;
        let locks = lock_with(options(&azurite));
        let error = locks.reader_writer("jobs").unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
        let error = locks
            .semaphore("jobs", MAX_SEMAPHORE_SLOTS + 1)
            .unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Misconfigured, "{error}");
        locks
            .semaphore("jobs", MAX_SEMAPHORE_SLOTS)
            .expect("the largest Azure semaphore");
    }
}
