//! The HTTP transport and retry policy: bounded, because a lock client must answer in time.
//!
//! The transport also keeps lock keys out of the SDK's request logs. A guard blob's name is
//! derived from its lock key, and the SDK logs every request URL (at debug level, and failed
//! ones at info). So LockingKit's own requests are built for a placeholder blob,
//! [`PLACEHOLDER_BLOB`], with the guard's real path carried in the call's context
//! ([`GuardPath`]); the transport, which runs after every SDK log line, puts the real path in
//! just for the send and takes it out again, so a retry is logged with the placeholder too.
//!
//! The SDK's defaults (connect timeout 20 s, read timeout 60 s, 8 retries up to 30 s apart,
//! honouring any `Retry-After`) make a call against a hung server take about two minutes to
//! fail. Renewals then outlive the loss deadline and waiters report nothing for minutes. Here
//! every try is cut off at the request timeout, retries are few and quick, and the whole call
//! is bounded again by the caller (see `GuardBlobs::call`).

use std::sync::Arc;
use std::time::Duration;

use azure_core::http::policies::{Policy, PolicyResult, RetryHeaders, RetryPolicy};
use azure_core::http::{Context, HttpClient, Request, RetryOptions, StatusCode, Transport};

use crate::backend::BackendError;

/// Delays between retries never exceed this, whatever the options say.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(1);

/// A reqwest client that gives up on any try after `timeout`.
///
/// TLS is rustls on the ring provider with the platform's certificate verifier, chosen
/// explicitly so that no process-wide crypto provider has to be installed.
pub(crate) fn transport(timeout: Duration) -> Result<Transport, BackendError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| BackendError::misconfigured(format!("TLS setup failed: {e}")))?;
    let verifier = rustls_platform_verifier::Verifier::new(provider)
        .map_err(|e| BackendError::misconfigured(format!("TLS verifier setup failed: {e}")))?;
    let tls = tls
        .dangerous() // only to plug in the platform verifier; verification stays on
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    let client = reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .timeout(timeout)
        .connect_timeout(timeout)
        // Storage never redirects; following one would resend a signed lease request elsewhere.
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| {
            BackendError::misconfigured(format!("the HTTP client could not be built: {e}"))
        })?;
    Ok(Transport::with_policy(Arc::new(Sending { client })))
}

/// The blob name LockingKit's own requests are built for, whatever the key: what the SDK's
/// logs show in place of the guard's real name.
pub(crate) const PLACEHOLDER_BLOB: &str = "lockingkit-guard";

/// The real URL path (percent-encoded, as sent) of the guard blob a call is for. Put into a
/// call's context by the guard blob code; read by the transport and by Shared Key signing.
#[derive(Clone)]
pub(crate) struct GuardPath(pub(crate) Arc<str>);

impl std::fmt::Debug for GuardPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The path is derived from a lock key.
        f.write_str("GuardPath([redacted])")
    }
}

impl GuardPath {
    /// The path of `blob`.
    pub(crate) fn of(blob: &azure_storage_blob::BlobClient) -> Self {
        GuardPath(blob.url().path().into())
    }

    /// A call context carrying this path.
    pub(crate) fn context(&self) -> Context<'static> {
        Context::new().with_value(self.clone())
    }

    /// The path a request must be signed and sent for: the guard's, when the call is for one.
    pub(crate) fn for_request<'a>(ctx: &'a Context<'_>, request: &'a Request) -> &'a str {
        match ctx.value::<GuardPath>() {
            Some(GuardPath(path)) => path,
            None => request.url().path(),
        }
    }
}

/// The end of the pipeline: sends the request, with the guard's real path in place of the
/// placeholder for exactly the duration of the send.
///
/// A guard request is sent by [`send_quietly`], not by the SDK's reqwest client, which logs
/// the URL it sends to and whose errors carry it. Other requests (the caller's own, through
/// [`AzureBlobLease::blob_client`](super::super::AzureBlobLease::blob_client)) go through the SDK's
/// client unchanged.
#[derive(Debug)]
struct Sending {
    client: reqwest::Client,
}

#[async_trait::async_trait]
impl Policy for Sending {
    async fn send(
        &self,
        ctx: &Context,
        request: &mut Request,
        _next: &[Arc<dyn Policy>],
    ) -> PolicyResult {
        let Some(GuardPath(path)) = ctx.value::<GuardPath>() else {
            return HttpClient::execute_request(&self.client, request).await;
        };
        let placeholder = request.url().path().to_owned();
        request.url_mut().set_path(path);
        let response = send_quietly(&self.client, request).await;
        // The retry policy sends this same request again, logging it first.
        request.url_mut().set_path(&placeholder);
        response
    }
}

/// Sends `request` without logging, reading the whole answer (guard requests and answers
/// are a few hundred bytes). Errors leave the URL out.
async fn send_quietly(client: &reqwest::Client, request: &Request) -> PolicyResult {
    use azure_core::error::ErrorKind;
    use azure_core::http::headers::{HeaderName, HeaderValue, Headers};
    use azure_core::http::{AsyncRawResponse, Body};

    let method = reqwest::Method::from_bytes(request.method().as_ref().as_bytes())
        .map_err(|_| azure_core::Error::with_message(ErrorKind::Other, "unknown HTTP method"))?;
    let body = match request.body() {
        Body::Bytes(bytes) => bytes.clone(),
        Body::SeekableStream(_) => {
            return Err(azure_core::Error::with_message(
                ErrorKind::Other,
                "guard blob requests carry no streamed body",
            ))
        }
    };
    let mut builder = client.request(method, request.url().clone());
    for (name, value) in request.headers().iter() {
        builder = builder.header(name.as_str(), value.as_str());
    }
    let failed = |error: reqwest::Error| {
        let kind = if error.is_connect() {
            ErrorKind::Connection
        } else {
            ErrorKind::Io
        };
        azure_core::Error::with_error(kind, error.without_url(), "the guard blob request failed")
    };
    let response = client
        .execute(builder.body(body).build().map_err(failed)?)
        .await
        .map_err(failed)?;
    let status = response.status().as_u16();
    let headers: std::collections::HashMap<HeaderName, HeaderValue> = response
        .headers()
        .iter()
        .filter_map(|(name, value)| {
            let value = value.to_str().ok()?;
            Some((
                HeaderName::from(name.as_str().to_owned()),
                HeaderValue::from(value.to_owned()),
            ))
        })
        .collect();
    let body = response.bytes().await.map_err(failed)?;
    Ok(AsyncRawResponse::from_bytes(
        status.into(),
        Headers::from(headers),
        body,
    ))
}

/// A few quick retries of failures that a second try may fix.
///
/// Retried: transport errors and 408, 429, 500, 502, 503, 504. `Retry-After` is ignored on
/// purpose: a server asking for a minute's pause must not stall a renewal past its deadline.
#[derive(Debug)]
pub(crate) struct QuickRetry {
    max_retries: u32,
    first_delay: Duration,
}

impl QuickRetry {
    pub(crate) fn options(max_retries: u32, first_delay: Duration) -> RetryOptions {
        if max_retries == 0 {
            return RetryOptions::none();
        }
        RetryOptions::custom(Arc::new(QuickRetry {
            max_retries,
            first_delay,
        }))
    }

    fn delay(&self, retry_count: u32) -> Duration {
        let doublings = retry_count.saturating_sub(1).min(16);
        self.first_delay
            .saturating_mul(1 << doublings)
            .min(MAX_RETRY_DELAY)
    }
}

#[async_trait::async_trait]
impl RetryPolicy for QuickRetry {
    fn is_expired(&self, _since_first_answer: azure_core::time::Duration, retries: u32) -> bool {
        retries >= self.max_retries
    }

    fn retry_headers(&self) -> Option<&RetryHeaders> {
        None
    }

    fn retry_status_codes(&self) -> &[StatusCode] {
        // Empty means the SDK's list: 408, 429, 500, 502, 503, 504.
        &[]
    }

    fn sleep_duration(&self, retry_count: u32) -> azure_core::time::Duration {
        azure_core::time::Duration::try_from(self.delay(retry_count))
            .unwrap_or(azure_core::time::Duration::SECOND)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_and_stay_under_a_second() {
        let policy = QuickRetry {
            max_retries: 5,
            first_delay: Duration::from_millis(100),
        };
        let delays: Vec<_> = (1..=6).map(|n| policy.delay(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1000, 1000]);
        assert!(!policy.is_expired(azure_core::time::Duration::ZERO, 4));
        assert!(policy.is_expired(azure_core::time::Duration::ZERO, 5));
    }

    #[test]
    fn the_transport_builds_without_a_global_crypto_provider() {
        assert!(transport(Duration::from_secs(1)).is_ok());
    }
}
