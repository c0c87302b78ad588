//! The Azure Blob lease provider (`feature = "azure"`), on the official GA SDK
//! (`azure_storage_blob` 1.x, `azure_core` 1.x).
//!
//! Each key is a *guard blob* in one container (named by
//! [`AzureLockKeys::guard_blob_name`](crate::keys::AzureLockKeys::guard_blob_name)); holding
//! the lock is holding the blob's lease. A missing guard is created empty with
//! `If-None-Match: *`; an existing guard's content and metadata are never touched except one
//! metadata entry, [`FENCING_TOKEN_METADATA`], written under the lease on every acquire.
//!
//! The lock protocol sits at the top of this folder: the backend and the lease handed to
//! callers here, the guard blobs (leases and fencing tokens) in `guard_blob`, and what storage
//! answers mean for a lock in `errors`. Under it, `client` is the SDK plumbing that reaches
//! the account: connection strings, Shared Key signing and a bounded HTTP transport.
//!
//! ```no_run
//! use std::time::Duration;
//! use lockingkit::providers::azure::{AzureBlobBackend, AzureBlobOptions};
//! use lockingkit::DistributedLock;
//!
//! # async fn demo() -> Result<(), lockingkit::LockError> {
//! let options = AzureBlobOptions::from_connection_string(std::env::var("STORAGE").unwrap_or_default())
//!     .with_container("locks")
//!     .with_lease_duration(Duration::from_secs(30));
//! let locks = DistributedLock::builder(AzureBlobBackend::new(options)?).name("Jobs").build()?;
//! let handle = locks.acquire("jobs/nightly-export", Duration::from_secs(10)).await?;
//! // … work, checking handle.ensure_held() between steps …
//! handle.release().await?;
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use azure_core::credentials::TokenCredential;

use azure_storage_blob::models::{BlobClientSetMetadataOptions, BlobClientUploadOptions};
use azure_storage_blob::{BlobClient, BlobContainerClient};

use crate::backend::{Acquired, BackendError, LeaseTiming, LockBackend, LockMode};
use crate::config::Problem;
use crate::error::LockError;

mod client;
mod errors;
mod guard_blob;
pub(crate) mod keys;
mod options;
mod provider;
mod semaphore;

pub use client::SharedKeyPolicy;
pub use errors::AzureRequestError;
pub use guard_blob::FENCING_TOKEN_METADATA;
pub use options::{AzureBlobOptions, MAX_LEASE_DURATION, MAX_RETRIES_LIMIT, MIN_LEASE_DURATION};
pub(crate) use provider::AzureBlob;
pub use semaphore::MAX_SEMAPHORE_SLOTS;

use client::{container_from_connection_string, container_with_token, GuardPath};
use guard_blob::GuardBlobs;

/// The section name used in errors when options are checked outside a registry.
const SECTION: &str = "AzureBlobOptions";

/// Locks on Azure Blob leases: a [`LockBackend`] for
/// [`DistributedLock::builder`](crate::DistributedLock::builder).
///
/// Cloning is cheap and shares the HTTP client. Each attempt takes the guard blob's lease with
/// a proposed lease id, creates a missing guard create-only, and raises the fencing token in
/// the guard's metadata under the lease. Leases are renewed by the engine every third of the
/// lease by default and released with the handle.
///
/// # Semaphores, and no reader-writer locks
///
/// A semaphore of `max_count` N (1 to [`MAX_SEMAPHORE_SLOTS`]) is N slot guard blobs, named by
/// [`AzureLockKeys::semaphore_slot_blob_name`](crate::keys::AzureLockKeys::semaphore_slot_blob_name);
/// a holder holds one slot's lease, renewed and released like a plain lock's. An attempt probes
/// the slots from a random one and takes the first free lease, so a busy semaphore costs up to
/// N requests per attempt. Fencing tokens are **per slot**: each slot blob keeps its own, growing
/// with every holder of that slot ([`AzureBlobLease::semaphore_slot`] says which).
///
/// Reader-writer locks are refused ([`LockBackend::supports`] is false for
/// [`LockMode::Shared`], which the engine reports as `Misconfigured`): a blob lease is
/// exclusive, Azure has no shared lease, and a lock that quietly let one reader in at a time
/// would not be the lock the caller asked for.
#[derive(Clone)]
pub struct AzureBlobBackend {
    guards: Arc<GuardBlobs>,
    lease_duration: Duration,
}

impl AzureBlobBackend {
    /// A backend for the account in `options.connection_string`.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured), listing every
    /// problem, when the options are invalid or name a `service_url` (which needs
    /// [`with_credential`](Self::with_credential)).
    /// Nothing is sent to Azure here (building stays synchronous and works offline): call
    /// [`verify`](Self::verify) at startup so that a wrong key, account or missing container
    /// stops the service there, rather than failing its first lock.
    pub fn new(options: AzureBlobOptions) -> Result<Self, LockError> {
        Self::open(options, None)
            .map_err(|problems| crate::config::misconfigured_at(SECTION, problems))
    }

    /// A backend for the blob service at `options.service_url`, authenticated with a Microsoft
    /// Entra token credential (for example a managed identity from `azure_identity`).
    ///
    /// The identity needs the *Storage Blob Data Contributor* role on the container. The URL
    /// must use `https`.
    pub fn with_credential(
        options: AzureBlobOptions,
        credential: Arc<dyn TokenCredential>,
    ) -> Result<Self, LockError> {
        Self::open(options, Some(credential))
            .map_err(|problems| crate::config::misconfigured_at(SECTION, problems))
    }

    /// A backend for `options`: with a `credential` the options must name a `service_url`,
    /// without one a `connection_string`. Lists every problem found, for the caller to place
    /// in the section the options came from.
    pub(crate) fn open(
        options: AzureBlobOptions,
        credential: Option<Arc<dyn TokenCredential>>,
    ) -> Result<Self, Vec<Problem>> {
        let mut problems = options.problems();
        match (
            &credential,
            &options.connection_string,
            &options.service_url,
        ) {
            (None, None, Some(_)) => problems.push(Problem::new(
                "service_url",
                "needs a token credential: give one to AzureBlobBackend::with_credential (in \
                 a registry, to LockingBuilder::azure_credential), or use connection_string",
            )),
            (Some(_), Some(_), None) => problems.push(Problem::new(
                "connection_string",
                "carries its own credential: give service_url with a token credential",
            )),
            _ => {}
        }
        if !problems.is_empty() {
            return Err(problems);
        }
        let container = match credential {
            None => container_from_connection_string(&options),
            Some(credential) => container_with_token(&options, credential),
        }
        .map_err(|problem| vec![problem])?;
        Ok(Self::from_container(container, &options))
    }

    fn from_container(container: BlobContainerClient, options: &AzureBlobOptions) -> Self {
        AzureBlobBackend {
            guards: Arc::new(GuardBlobs::new(
                container,
                &options.container,
                options.lease_duration,
                options.request_timeout,
            )),
            lease_duration: options.lease_duration,
        }
    }

    /// Checks, with one request, that the endpoint answers, the account exists, the
    /// credential may read blobs and the container exists, so a deployment that cannot lock
    /// fails at startup.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured) naming what is
    /// wrong (for a missing container, its name), or
    /// [`ErrorKind::Unavailable`](crate::ErrorKind::Unavailable) when the service does not
    /// answer within `request_timeout`. Nothing is created or written. [`Locking::verify`] runs this for
    /// every Azure provider of a registry.
    ///
    /// [`Locking::verify`]: crate::registry::Locking::verify
    ///
    /// ```no_run
    /// # use lockingkit::{AzureBlobBackend, AzureBlobOptions, DistributedLock};
    /// # async fn run() -> Result<(), lockingkit::LockError> {
    /// let backend = AzureBlobBackend::new(AzureBlobOptions::from_connection_string(
    ///     std::env::var("STORAGE").unwrap_or_default(),
    /// ))?;
    /// backend.verify().await?; // locking.misconfigured: the container `locks` does not exist …
    /// let locks = DistributedLock::builder(backend).build()?;
    /// # Ok(()) }
    /// ```
    pub async fn verify(&self) -> Result<(), LockError> {
        self.guards
            .verify()
            .await
            .map_err(BackendError::into_lock_error)
    }

    /// Creates the container if it does not exist: for development and tests (a fresh
    /// Azurite has no containers).
    ///
    /// Creating containers needs more rights than locking (the account key, an account SAS
    /// or *Storage Blob Data Contributor* on the account, not just the container), which a
    /// production identity should not have; there, create the container with your
    /// infrastructure and call [`verify`](Self::verify) instead. Fails like `verify`.
    pub async fn ensure_container(&self) -> Result<(), LockError> {
        self.guards
            .ensure_container()
            .await
            .map_err(BackendError::into_lock_error)
    }

    /// The lease duration.
    pub fn lease_duration(&self) -> Duration {
        self.lease_duration
    }

    /// The container client, for setup and operations (creating the container, listing
    /// guards). It authenticates like the backend.
    pub fn container_client(&self) -> &BlobContainerClient {
        self.guards.container()
    }

    /// The client of `key`'s guard blob, named by
    /// [`AzureLockKeys::guard_blob_name`](crate::keys::AzureLockKeys::guard_blob_name), so
    /// operators can find and inspect it.
    pub fn guard_blob(&self, key: &str) -> BlobClient {
        self.guards.guard(key)
    }

    /// The client of slot `slot` (from 0) of the semaphore `key`, named by
    /// [`AzureLockKeys::semaphore_slot_blob_name`](crate::keys::AzureLockKeys::semaphore_slot_blob_name),
    /// so operators can find and inspect it.
    pub fn semaphore_slot_blob(&self, key: &str, slot: u32) -> BlobClient {
        self.guards.slot(key, slot)
    }
}

impl fmt::Debug for AzureBlobBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The container URL is left out: with a SAS it carries the signature.
        f.debug_struct("AzureBlobBackend")
            .field("lease_duration", &self.lease_duration)
            .finish_non_exhaustive()
    }
}

impl LockBackend for AzureBlobBackend {
    type Lease = AzureBlobLease;

    /// One request: see [`AzureBlobBackend::verify`].
    async fn verify(&self) -> Result<(), BackendError> {
        self.guards.verify().await
    }

    fn provider(&self) -> &str {
        "azure_blob"
    }

    fn timing(&self) -> LeaseTiming {
        LeaseTiming::Expiring(self.lease_duration)
    }

    /// Exclusive locks, and semaphores of 1 to [`MAX_SEMAPHORE_SLOTS`] holders; never shared
    /// holds, which blob leases cannot express.
    fn supports(&self, mode: LockMode) -> bool {
        match mode {
            LockMode::Exclusive => true,
            LockMode::Semaphore { max_count } => semaphore::supported_count(max_count),
            LockMode::Shared => false,
        }
    }

    async fn try_acquire(
        &self,
        key: &str,
        mode: LockMode,
    ) -> Result<Option<Acquired<AzureBlobLease>>, BackendError> {
        let lease = match mode {
            LockMode::Exclusive => self.guards.try_acquire(key).await?,
            LockMode::Semaphore { max_count } if semaphore::supported_count(max_count) => {
                semaphore::try_acquire_slot(&self.guards, key, max_count).await?
            }
            LockMode::Semaphore { max_count } => {
                return Err(BackendError::misconfigured(format!(
                    "a semaphore on Azure admits 1 to {MAX_SEMAPHORE_SLOTS} holders, not \
                     {max_count}: each holder is a slot blob, and an attempt may try every slot"
                )))
            }
            LockMode::Shared => {
                return Err(BackendError::misconfigured(
                    "reader-writer locks are not available on Azure: a blob lease is \
                     exclusive, so readers could not share it",
                ))
            }
        };
        Ok(lease.map(|lease| Acquired {
            fencing_token: lease.fencing_token,
            lease,
        }))
    }

    async fn renew(&self, lease: &AzureBlobLease) -> Result<(), BackendError> {
        self.guards.renew(lease).await
    }

    async fn release(&self, lease: &AzureBlobLease) -> Result<(), BackendError> {
        self.guards.release(lease).await
    }
}

/// A held Azure lock's guard blob and lease, for writes fenced by the lease itself.
///
/// For a semaphore holder the guard blob is the slot it holds
/// ([`semaphore_slot`](Self::semaphore_slot)), and the fencing token is that slot's.
///
/// Get it from [`LockHandle::azure_blob_lease`](crate::LockHandle::azure_blob_lease). Azure
/// refuses a write that carries a lease id which is no longer the blob's lease (412), so a
/// process that lost the lock — paused, partitioned, or whose lease was broken — cannot
/// overwrite the guard blob however late its write arrives.
///
/// ```no_run
/// # use azure_core::Bytes;
/// # async fn demo(handle: lockingkit::LockHandle) -> Result<(), Box<dyn std::error::Error>> {
/// let lease = handle.azure_blob_lease().expect("an Azure lock");
/// lease
///     .blob_client()
///     .upload(Bytes::from_static(b"state written under the lock").into(), Some(lease.upload_options()))
///     .await?; // 412 once the lease is gone
/// # Ok(()) }
/// ```
///
/// Uploading replaces a blob's metadata, so [`upload_options`](Self::upload_options) carries
/// the fencing token entry along; keep [`FENCING_TOKEN_METADATA`] in any metadata you write
/// (see [`with_fencing_token`](Self::with_fencing_token)), or the next holder's token restarts
/// from one.
#[derive(Clone)]
pub struct AzureBlobLease {
    blob: Arc<BlobClient>,
    /// Where LockingKit's own requests for this guard go (see `client::transport`).
    path: GuardPath,
    lease_id: String,
    fencing_token: u64,
    /// The semaphore slot this lease holds; `None` for a plain lock.
    slot: Option<u32>,
}

impl AzureBlobLease {
    /// The guard blob's client (same account, credentials and pipeline as the lock).
    pub fn blob_client(&self) -> &BlobClient {
        &self.blob
    }

    /// The lease id to send as `x-ms-lease-id` with writes to the guard blob.
    pub fn lease_id(&self) -> &str {
        &self.lease_id
    }

    /// The fencing token of this hold. For a semaphore it is the slot's own token: it grows
    /// with each holder of this slot, and tokens of different slots are not comparable.
    pub fn fencing_token(&self) -> u64 {
        self.fencing_token
    }

    /// The semaphore slot (from 0) whose blob this lease holds; `None` for a plain lock.
    pub fn semaphore_slot(&self) -> Option<u32> {
        self.slot
    }

    /// `metadata` plus the fencing token entry, for writes that replace the guard's metadata.
    pub fn with_fencing_token(
        &self,
        mut metadata: HashMap<String, String>,
    ) -> HashMap<String, String> {
        metadata.insert(
            FENCING_TOKEN_METADATA.to_owned(),
            self.fencing_token.to_string(),
        );
        metadata
    }

    /// Upload options fenced by the lease, keeping the fencing token in the new metadata.
    pub fn upload_options(&self) -> BlobClientUploadOptions<'static> {
        BlobClientUploadOptions {
            lease_id: Some(self.lease_id.clone()),
            metadata: Some(self.with_fencing_token(HashMap::new())),
            ..Default::default()
        }
    }

    /// Set-metadata options fenced by the lease; pass metadata through
    /// [`with_fencing_token`](Self::with_fencing_token).
    pub fn set_metadata_options(&self) -> BlobClientSetMetadataOptions<'static> {
        BlobClientSetMetadataOptions {
            lease_id: Some(self.lease_id.clone()),
            ..Default::default()
        }
    }
}

impl crate::LockHandle {
    /// The guard blob and lease id of an Azure lock, to fence writes to the guard blob itself;
    /// `None` for locks of other providers.
    pub fn azure_blob_lease(&self) -> Option<AzureBlobLease> {
        self.lease::<AzureBlobLease>().cloned()
    }
}

impl fmt::Debug for AzureBlobLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The blob URL is the key (and may carry a SAS); the lease id is a write capability.
        f.debug_struct("AzureBlobLease")
            .field("fencing_token", &self.fencing_token)
            .field("semaphore_slot", &self.slot)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn a_backend_is_built_without_contacting_azure() {
        let backend = AzureBlobBackend::new(AzureBlobOptions::from_connection_string(
            "UseDevelopmentStorage=true",
        ))
        .unwrap();
        assert_eq!(backend.provider(), "azure_blob");
        assert_eq!(
            backend.timing(),
            LeaseTiming::Expiring(Duration::from_secs(30))
        );
        let blob = backend.guard_blob("orders/42");
        assert_eq!(
            blob.url().as_str(),
            "http://127.0.0.1:10000/devstoreaccount1/locks/orders%2F42"
        );
        assert!(!format!("{backend:?}").contains("devstoreaccount1"));
    }

    #[test]
    fn sas_rides_on_every_guard_url() {
        let backend = AzureBlobBackend::new(AzureBlobOptions::from_connection_string(
            "BlobEndpoint=https://acct.blob.core.windows.net;SharedAccessSignature=sv=1&sig=abc",
        ))
        .unwrap();
        let url = backend.guard_blob("a/b").url().to_string();
        assert_eq!(
            url,
            "https://acct.blob.core.windows.net/locks/a%2Fb?sv=1&sig=abc"
        );
    }

    #[test]
    fn bad_options_fail_with_every_problem_and_no_secret() {
        let options = AzureBlobOptions::from_connection_string("AccountName=a;AccountKey=hunter2!")
            .with_lease_duration(Duration::from_secs(14));
        let error = AzureBlobBackend::new(options).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Misconfigured);
        let text = error.to_string();
        assert!(
            text.contains("lease_duration") && text.contains("AccountKey"),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[derive(Debug)]
    struct FixedToken;

    #[async_trait::async_trait]
    impl TokenCredential for FixedToken {
        async fn get_token(
            &self,
            _scopes: &[&str],
            _options: Option<azure_core::credentials::TokenRequestOptions<'_>>,
        ) -> azure_core::Result<azure_core::credentials::AccessToken> {
            Ok(azure_core::credentials::AccessToken::new(
                "token",
                azure_core::time::OffsetDateTime::now_utc() + azure_core::time::Duration::HOUR,
            ))
        }
    }

    #[test]
    fn a_service_url_needs_a_credential_and_a_connection_string_refuses_one() {
        let error = AzureBlobBackend::new(AzureBlobOptions::from_service_url(
            "https://a.blob.core.windows.net",
        ))
        .unwrap_err();
        assert!(error.to_string().contains("with_credential"));

        let credential: Arc<dyn TokenCredential> = Arc::new(FixedToken);
        let backend = AzureBlobBackend::with_credential(
            AzureBlobOptions::from_service_url("https://a.blob.core.windows.net"),
            credential.clone(),
        )
        .unwrap();
        assert_eq!(
            backend.guard_blob("orders/42").url().as_str(),
            "https://a.blob.core.windows.net/locks/orders%2F42"
        );
        let over_http = AzureBlobBackend::with_credential(
            AzureBlobOptions::from_service_url("http://a.blob.core.windows.net"),
            credential.clone(),
        )
        .unwrap_err();
        assert!(over_http.to_string().contains("https"), "{over_http}");
        let both = AzureBlobBackend::with_credential(
            AzureBlobOptions::from_connection_string("UseDevelopmentStorage=true"),
            credential,
        )
        .unwrap_err();
        assert_eq!(both.kind(), ErrorKind::Misconfigured);
    }
}
