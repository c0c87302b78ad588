//! Guard blobs: one blob per key, whose lease is the lock and whose metadata keeps the
//! fencing token.
//!
//! An acquire is: take the lease (creating the guard empty and create-only if it is missing),
//! read the metadata, and write it back with the token raised by one, under the lease. The
//! read is skipped when the lease answer's ETag is the one our own last token write produced:
//! the blob has not changed since, so the metadata we wrote is still what it holds. A process
//! re-taking its own locks therefore spends two requests per acquire instead of three.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use azure_core::http::{ClientMethodOptions, Etag, NoFormat, RequestContent, Response};
use azure_core::{Bytes, Uuid};
use azure_storage_blob::models::{
    BlobClientAcquireLeaseOptions, BlobClientAcquireLeaseResult,
    BlobClientAcquireLeaseResultHeaders, BlobClientGetPropertiesOptions,
    BlobClientGetPropertiesResultHeaders, BlobClientReleaseLeaseOptions,
    BlobClientRenewLeaseOptions, BlobClientSetMetadataOptions, BlobClientUploadOptions,
};
use azure_storage_blob::{BlobClient, BlobContainerClient};

use super::client::{GuardPath, PLACEHOLDER_BLOB};
use super::errors;
use super::keys::AzureLockKeys;
use super::AzureBlobLease;
use crate::backend::BackendError;

/// The metadata entry holding a guard's fencing token: the last token handed out, in decimal.
pub const FENCING_TOKEN_METADATA: &str = "lockingkit_fencing_token";

/// How many guards' last-written metadata a backend remembers before starting over.
const MAX_KNOWN_GUARDS: usize = 1024;

/// The service's answer granting a lease.
type LeaseGranted = Response<BlobClientAcquireLeaseResult, NoFormat>;

/// Storage answers to an acquire that mean someone else holds the lease.
const BUSY_CODES: &[&str] = &["LeaseAlreadyPresent", "LeaseIsBreakingAndCannotBeAcquired"];

/// What our last token write left on a guard.
struct KnownGuard {
    etag: Etag,
    metadata: HashMap<String, String>,
}

/// The guard blobs of one container, reached through one SDK pipeline.
///
/// Every request goes to the placeholder blob's client with the guard's real path in its
/// context (see `transport`), so the SDK's request logs never show a name derived from a key.
pub(crate) struct GuardBlobs {
    container: BlobContainerClient,
    /// The container's name, for messages that tell an operator what to create.
    container_name: String,
    placeholder: Arc<BlobClient>,
    lease_seconds: i32,
    request_timeout: Duration,
    known: Mutex<HashMap<String, KnownGuard>>,
}

impl GuardBlobs {
    pub(crate) fn new(
        container: BlobContainerClient,
        container_name: &str,
        lease_duration: Duration,
        request_timeout: Duration,
    ) -> Self {
        GuardBlobs {
            placeholder: Arc::new(container.blob_client(PLACEHOLDER_BLOB)),
            container,
            container_name: container_name.to_owned(),
            // Validated to 15..=60 whole seconds before we get here.
            lease_seconds: i32::try_from(lease_duration.as_secs()).unwrap_or(60),
            request_timeout,
            known: Mutex::new(HashMap::new()),
        }
    }

    pub(crate) fn container(&self) -> &BlobContainerClient {
        &self.container
    }

    pub(crate) fn guard(&self, key: &str) -> BlobClient {
        self.container
            .blob_client(&AzureLockKeys::guard_blob_name(key))
    }

    pub(crate) fn slot(&self, key: &str, slot: u32) -> BlobClient {
        self.container
            .blob_client(&AzureLockKeys::semaphore_slot_blob_name(key, slot))
    }

    fn classify(&self, operation: &'static str, error: &azure_core::Error) -> BackendError {
        errors::classify(&self.container_name, operation, error)
    }

    /// Asks for the placeholder blob's properties, the cheapest request that needs what every
    /// lock needs: the endpoint, the account, a credential allowed to read blobs, and the
    /// container. "No such blob" is the expected answer and means all four are right.
    ///
    /// The placeholder is read, never written: no blob is created by a check.
    pub(crate) async fn verify(&self) -> Result<(), BackendError> {
        let request = self.placeholder.get_properties(None);
        self.call_expecting("check container", request, (404, "BlobNotFound"))
            .await
    }

    /// Creates the container unless it exists.
    pub(crate) async fn ensure_container(&self) -> Result<(), BackendError> {
        let request = self.container.create(None);
        self.call_expecting("create container", request, (409, "ContainerAlreadyExists"))
            .await
    }

    /// Sends `request`, for which success and the error `expected` (status, code) both mean
    /// the account is in the state asked for.
    async fn call_expecting<T>(
        &self,
        operation: &'static str,
        request: impl Future<Output = azure_core::Result<T>>,
        expected: (u16, &str),
    ) -> Result<(), BackendError> {
        match self.call(operation, request).await? {
            Ok(_) => Ok(()),
            Err(e) if errors::is(&e, expected.0, expected.1) => Ok(()),
            Err(e) => Err(self.classify(operation, &e)),
        }
    }

    /// Runs one SDK call within the request timeout, retries included.
    async fn call<T>(
        &self,
        operation: &'static str,
        request: impl Future<Output = azure_core::Result<T>>,
    ) -> Result<azure_core::Result<T>, BackendError> {
        tokio::time::timeout(self.request_timeout, request)
            .await
            .map_err(|_| errors::timed_out(operation, self.request_timeout))
    }

    /// [`call`](Self::call), with an error the SDK answers classified as one of `operation`.
    async fn call_classified<T>(
        &self,
        operation: &'static str,
        request: impl Future<Output = azure_core::Result<T>>,
    ) -> Result<T, BackendError> {
        self.call(operation, request)
            .await?
            .map_err(|e| self.classify(operation, &e))
    }

    /// One attempt at `key`'s guard: `Ok(None)` when someone else holds the lease.
    pub(crate) async fn try_acquire(
        &self,
        key: &str,
    ) -> Result<Option<AzureBlobLease>, BackendError> {
        self.try_acquire_named(AzureLockKeys::guard_blob_name(key), None)
            .await
    }

    /// One attempt at the guard blob `name` (a semaphore's slot `slot`, or a plain lock's
    /// guard when `None`): `Ok(None)` when someone else holds the lease.
    pub(crate) async fn try_acquire_named(
        &self,
        name: String,
        slot: Option<u32>,
    ) -> Result<Option<AzureBlobLease>, BackendError> {
        // The real guard's client is for the caller's fenced writes; our own requests go
        // through the placeholder with this path.
        let blob = Arc::new(self.container.blob_client(&name));
        let path = GuardPath::of(&blob);
        // A fresh id per attempt: if the SDK resends the acquire because the first answer was
        // lost, the service sees the same id and grants the lease again instead of saying 409.
        let proposed = Uuid::new_v4().to_string();
        let Some(granted) = self.take_lease(&path, &proposed).await? else {
            return Ok(None);
        };
        let lease_id = match granted.lease_id() {
            Ok(Some(id)) => id,
            _ => proposed,
        };
        let etag = granted.etag().ok().flatten();
        let fencing_token = self.fence(&path, &name, &lease_id, etag).await?;
        Ok(Some(AzureBlobLease {
            blob,
            path,
            lease_id,
            fencing_token,
            slot,
        }))
    }

    /// Takes the guard's lease with the id `proposed`, creating the guard (once) if it is
    /// missing: the service's answer, or `Ok(None)` when someone else holds the lease.
    async fn take_lease(
        &self,
        path: &GuardPath,
        proposed: &str,
    ) -> Result<Option<LeaseGranted>, BackendError> {
        let mut created = false;
        loop {
            match self.request_lease(path, proposed).await? {
                Ok(granted) => return Ok(Some(granted)),
                Err(e) if BUSY_CODES.iter().any(|code| errors::is(&e, 409, code)) => {
                    return Ok(None)
                }
                Err(e) if errors::is(&e, 404, "BlobNotFound") && !created => {
                    self.create_guard(path).await?;
                    created = true;
                }
                Err(e) if errors::is(&e, 404, "BlobNotFound") => {
                    // Deleted between our create and our acquire: a race worth another attempt.
                    return Err(BackendError::transient(
                        "the guard blob was deleted while it was being created",
                    ));
                }
                Err(e) => {
                    let error = self.classify("acquire lease", &e);
                    if !error_reached(&error) {
                        self.release_in_background(path, proposed);
                    }
                    return Err(error);
                }
            }
        }
    }

    /// Sends one acquire-lease request with the id `proposed`. When no answer comes, the
    /// lease it may have granted is given back in the background.
    async fn request_lease(
        &self,
        path: &GuardPath,
        proposed: &str,
    ) -> Result<azure_core::Result<LeaseGranted>, BackendError> {
        let options = BlobClientAcquireLeaseOptions {
            proposed_lease_id: Some(proposed.to_owned()),
            method_options: in_context(path),
            ..Default::default()
        };
        let acquire = self
            .placeholder
            .acquire_lease(self.lease_seconds, Some(options));
        let answer = self.call("acquire lease", acquire).await;
        if answer.is_err() {
            self.release_in_background(path, proposed);
        }
        answer
    }

    /// Raises the fencing token under a freshly granted lease. The lease is ours but useless
    /// without a token, so if that fails it is given back now rather than leave the key
    /// blocked until the lease runs out.
    async fn fence(
        &self,
        path: &GuardPath,
        name: &str,
        lease_id: &str,
        lease_etag: Option<Etag>,
    ) -> Result<u64, BackendError> {
        let raised = self
            .raise_fencing_token(path, name, lease_id, lease_etag)
            .await;
        if raised.is_err() {
            let _ = self.release_lease(path, lease_id).await;
        }
        raised
    }

    /// Gives up a lease this attempt may have been granted without hearing the answer (the
    /// request timed out or the connection broke after it was sent). The lease id is the one
    /// we proposed, so the release works if the service did grant it; otherwise it fails
    /// harmlessly. Without it the key would stay blocked until the lease ran out.
    fn release_in_background(&self, path: &GuardPath, lease_id: &str) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let blob = self.placeholder.clone();
        let options = BlobClientReleaseLeaseOptions {
            method_options: in_context(path),
            ..Default::default()
        };
        let lease_id = lease_id.to_owned();
        let timeout = self.request_timeout;
        runtime.spawn(async move {
            let release = blob.release_lease(lease_id, Some(options));
            let _ = tokio::time::timeout(timeout, release).await;
        });
    }

    /// Creates the guard empty, only if it does not exist yet.
    async fn create_guard(&self, path: &GuardPath) -> Result<(), BackendError> {
        let content: RequestContent<Bytes, _> = RequestContent::from(Vec::new());
        let options = BlobClientUploadOptions {
            method_options: in_context(path),
            ..Default::default()
        }
        .if_not_exists();
        match self
            .call(
                "create guard blob",
                self.placeholder.upload(content, Some(options)),
            )
            .await?
        {
            Ok(_) => Ok(()),
            // Someone else created it first (a leased blob answers 412 to the same condition).
            Err(e)
                if errors::is(&e, 409, "BlobAlreadyExists")
                    || matches!(errors::status_and_code(&e), Some((412, _))) =>
            {
                Ok(())
            }
            Err(e) => Err(self.classify("create guard blob", &e)),
        }
    }

    /// Reads the token, writes it back plus one with the other metadata kept, under the lease.
    async fn raise_fencing_token(
        &self,
        path: &GuardPath,
        name: &str,
        lease_id: &str,
        lease_etag: Option<Etag>,
    ) -> Result<u64, BackendError> {
        let remembered = lease_etag.as_ref().and_then(|etag| {
            let known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
            known
                .get(name)
                .filter(|guard| &guard.etag == etag)
                .map(|guard| guard.metadata.clone())
        });
        let mut metadata = match remembered {
            Some(metadata) => metadata,
            None => {
                let options = BlobClientGetPropertiesOptions {
                    lease_id: Some(lease_id.to_owned()),
                    method_options: in_context(path),
                    ..Default::default()
                };
                let properties = self
                    .call_classified(
                        "read fencing token",
                        self.placeholder.get_properties(Some(options)),
                    )
                    .await
                    .map_err(during_acquire)?;
                properties
                    .metadata()
                    .map_err(|_| errors::unexpected("read fencing token", "unreadable metadata"))?
            }
        };
        let last = match metadata.get(FENCING_TOKEN_METADATA) {
            None => 0,
            Some(text) => text.trim().parse::<u64>().map_err(|_| {
                errors::unexpected(
                    "read fencing token",
                    "the guard's fencing token metadata is not a number",
                )
            })?,
        };
        let next = last.checked_add(1).ok_or_else(|| {
            errors::unexpected("read fencing token", "the fencing token is exhausted")
        })?;
        metadata.insert(FENCING_TOKEN_METADATA.to_owned(), next.to_string());
        let options = BlobClientSetMetadataOptions {
            lease_id: Some(lease_id.to_owned()),
            method_options: in_context(path),
            ..Default::default()
        };
        let written = self
            .call_classified(
                "write fencing token",
                self.placeholder.set_metadata(&metadata, Some(options)),
            )
            .await
            .map_err(during_acquire)?;
        let etag = written
            .headers()
            .get_optional_str(&azure_core::http::headers::ETAG)
            .map(Etag::from);
        self.remember(name, etag, metadata);
        Ok(next)
    }

    fn remember(&self, name: &str, etag: Option<Etag>, metadata: HashMap<String, String>) {
        let mut known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        match etag {
            Some(etag) => {
                if known.len() >= MAX_KNOWN_GUARDS && !known.contains_key(name) {
                    known.clear();
                }
                known.insert(name.to_owned(), KnownGuard { etag, metadata });
            }
            None => {
                known.remove(name);
            }
        }
    }

    pub(crate) async fn renew(&self, lease: &AzureBlobLease) -> Result<(), BackendError> {
        let options = BlobClientRenewLeaseOptions {
            method_options: in_context(&lease.path),
            ..Default::default()
        };
        self.call_classified(
            "renew lease",
            self.placeholder
                .renew_lease(lease.lease_id.clone(), Some(options)),
        )
        .await
        .map(drop)
    }

    pub(crate) async fn release(&self, lease: &AzureBlobLease) -> Result<(), BackendError> {
        self.release_lease(&lease.path, &lease.lease_id).await
    }

    async fn release_lease(&self, path: &GuardPath, lease_id: &str) -> Result<(), BackendError> {
        let options = BlobClientReleaseLeaseOptions {
            method_options: in_context(path),
            ..Default::default()
        };
        self.call_classified(
            "release lease",
            self.placeholder
                .release_lease(lease_id.to_owned(), Some(options)),
        )
        .await
        .map(drop)
    }
}

/// Options for a call to the guard at `path`, made through the placeholder blob's client.
fn in_context(path: &GuardPath) -> ClientMethodOptions<'static> {
    ClientMethodOptions {
        context: path.context(),
    }
}

/// Whether the service answered before the failure.
fn error_reached(error: &BackendError) -> bool {
    !matches!(
        error.kind(),
        crate::backend::BackendErrorKind::Transient { reached: false }
    )
}

/// A lease lost between being granted and getting its token is not a lost lock (the caller
/// never held it): report it as a failed attempt that may be retried.
fn during_acquire(error: BackendError) -> BackendError {
    if error.kind() == crate::backend::BackendErrorKind::LeaseGone {
        BackendError::transient(format!(
            "the lease was lost while the fencing token was written ({error})"
        ))
        .with_source(error)
    } else {
        error
    }
}
