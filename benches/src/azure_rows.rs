//! What LockingKit adds to an Azure lease round trip: an acquire+release through the lock next
//! to the raw SDK sending the same requests, interleaved in one run against one Azurite.
//!
//! Per pair, LockingKit sends *acquire lease* (with a proposed lease id), *set metadata* (the
//! fencing token, under the lease) and *release lease*; the metadata read is skipped because the
//! lease answer's ETag shows the guard is unchanged since this process wrote it. The raw
//! baseline sends exactly those three requests through an SDK client with the same transport
//! settings and signing, keeping its token in memory the same way. A second baseline adds the
//! metadata read (four requests), for what a straightforward implementation would cost.

use std::collections::HashMap;
use std::time::Duration;

use azure_core::http::RequestContent;
use azure_core::Uuid;
use azure_storage_blob::models::{
    BlobClientAcquireLeaseOptions, BlobClientGetPropertiesOptions,
    BlobClientGetPropertiesResultHeaders, BlobClientSetMetadataOptions,
};
use azure_storage_blob::BlobClient;
use lockingkit::keys::AzureLockKeys;
use lockingkit::providers::azure::{AzureBlobBackend, AzureBlobOptions, FENCING_TOKEN_METADATA};
use lockingkit_tests::azurite::Azurite;
use tokio::sync::Mutex;

use crate::pair::{lock_on, lock_pair};
use crate::samples::{interleaved, timed, Order, Percentiles, Rounds};
use crate::table::ms;

/// Medians of one run.
#[derive(Clone, Debug)]
pub struct AzureBenchReport {
    /// Pairs measured per variant.
    pub pairs: usize,
    /// LockingKit `try_acquire` + `release`.
    pub lockingkit: Duration,
    /// The raw SDK sending the same three requests.
    pub raw_same_requests: Duration,
    /// The raw SDK also reading the metadata first (four requests).
    pub raw_with_read: Duration,
}

impl AzureBenchReport {
    /// LockingKit's median over the raw SDK's with the same requests.
    pub fn ratio(&self) -> f64 {
        self.lockingkit.as_secs_f64() / self.raw_same_requests.as_secs_f64()
    }

    /// A few lines for humans.
    pub fn render(&self) -> String {
        format!(
            "Azure acquire+release on Azurite, {} interleaved pairs each, medians:\n\
             \x20 lockingkit try_acquire+release      {:>9.3} ms\n\
             \x20 raw SDK, same 3 requests            {:>9.3} ms\n\
             \x20 raw SDK, 4 requests (reads metadata) {:>8.3} ms\n\
             \x20 ratio lockingkit / raw same requests {:>8.3} (goal <= 1.10)",
            self.pairs,
            ms(self.lockingkit),
            ms(self.raw_same_requests),
            ms(self.raw_with_read),
            self.ratio()
        )
    }
}

/// The raw SDK's version of one pair.
struct RawPair {
    blob: BlobClient,
    token: u64,
    metadata: HashMap<String, String>,
}

impl RawPair {
    async fn run(&mut self, read_metadata: bool) {
        let acquire = BlobClientAcquireLeaseOptions {
            proposed_lease_id: Some(Uuid::new_v4().to_string()),
            ..Default::default()
        };
        let answer = self
            .blob
            .acquire_lease(30, Some(acquire))
            .await
            .expect("raw acquire");
        let lease_id =
            azure_storage_blob::models::BlobClientAcquireLeaseResultHeaders::lease_id(&answer)
                .expect("lease id header")
                .expect("lease id");
        if read_metadata {
            let properties = self
                .blob
                .get_properties(Some(BlobClientGetPropertiesOptions {
                    lease_id: Some(lease_id.clone()),
                    ..Default::default()
                }))
                .await
                .expect("raw properties");
            self.metadata = properties.metadata().expect("metadata");
        }
        self.token += 1;
        self.metadata
            .insert(FENCING_TOKEN_METADATA.to_owned(), self.token.to_string());
        self.blob
            .set_metadata(
                &self.metadata,
                Some(BlobClientSetMetadataOptions {
                    lease_id: Some(lease_id.clone()),
                    ..Default::default()
                }),
            )
            .await
            .expect("raw metadata");
        self.blob
            .release_lease(lease_id, None)
            .await
            .expect("raw release");
    }
}

/// Measures `pairs` pairs of each variant, interleaved, after a warm-up.
pub async fn measure(azurite: &Azurite, pairs: usize) -> AzureBenchReport {
    let options = AzureBlobOptions::from_connection_string(azurite.connection_string());
    let locks = lock_on(AzureBlobBackend::new(options).expect("valid options"));
    let lock_key = format!("bench/lockingkit/{}", Uuid::new_v4());

    let container = azurite.plain_container_client("locks");
    let mut raw = Vec::new();
    for variant in ["same", "read"] {
        let blob = container.blob_client(&AzureLockKeys::guard_blob_name(&format!(
            "bench/raw-{variant}/{}",
            Uuid::new_v4()
        )));
        blob.upload(RequestContent::from(Vec::new()), None)
            .await
            .expect("raw guard");
        raw.push(Mutex::new(RawPair {
            blob,
            token: 0,
            metadata: HashMap::new(),
        }));
    }

    // Rotate the order so no variant always runs right after another.
    let rounds = Rounds::new(pairs, 20, Order::Rotated);
    let samples = interleaved(rounds, |variant| {
        let (locks, lock_key, raw) = (&locks, &lock_key, &raw);
        async move {
            match variant {
                0 => timed(lock_pair(locks, lock_key)).await,
                1 => timed(raw[0].lock().await.run(false)).await,
                _ => timed(raw[1].lock().await.run(true)).await,
            }
        }
    })
    .await;
    let [kit, same, read] = samples.map(|samples| Percentiles::of(samples).p50);
    AzureBenchReport {
        pairs,
        lockingkit: kit,
        raw_same_requests: same,
        raw_with_read: read,
    }
}
