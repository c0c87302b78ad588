//! The HTTP transport and retry policy: bounded, because a lock client must answer in time.
//!
//! The SDK's defaults (connect timeout 20 s, read timeout 60 s, 8 retries up to 30 s apart,
//! honouring any `Retry-After`) make a call against a hung server take about two minutes to
//! fail. Renewals then outlive the loss deadline and waiters report nothing for minutes. Here
//! every try is cut off at the request timeout, retries are few and quick, and the whole call
//! is bounded again by the caller (see `GuardBlobs::call`).

use std::sync::Arc;
use std::time::Duration;

use azure_core::http::policies::{RetryHeaders, RetryPolicy};
use azure_core::http::{RetryOptions, StatusCode, Transport};

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
    Ok(Transport::new(Arc::new(client)))
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
