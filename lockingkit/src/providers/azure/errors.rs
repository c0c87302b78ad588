//! How Azure Storage answers map onto [`BackendError`] kinds.
//!
//! SDK errors are never passed on as they are: their messages can carry the request URL, which
//! holds the guard blob name (the lock key) and, with a SAS, the signature. What is kept is the
//! operation, the HTTP status and the storage error code.

use std::fmt;
use std::time::Duration;

use azure_core::error::ErrorKind as SdkErrorKind;

use crate::backend::BackendError;

/// One failed request to Azure Storage, without the URL, key or credentials.
///
/// This is the [`source`](std::error::Error::source) of the [`LockError`](crate::LockError)s
/// and [`BackendError`]s the Azure provider returns, for callers who want the status and
/// storage error code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AzureRequestError {
    operation: &'static str,
    status: Option<u16>,
    error_code: Option<String>,
    detail: &'static str,
}

impl AzureRequestError {
    /// What was being done: `acquire lease`, `renew lease`, `write fencing token`, …
    pub fn operation(&self) -> &'static str {
        self.operation
    }

    /// The HTTP status, if the service answered.
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// The storage error code (`x-ms-error-code`), such as `LeaseAlreadyPresent`.
    pub fn error_code(&self) -> Option<&str> {
        self.error_code.as_deref()
    }
}

impl fmt::Display for AzureRequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.operation)?;
        match (self.status, &self.error_code) {
            (Some(status), Some(code)) => write!(f, "{status} {code}"),
            (Some(status), None) => write!(f, "{status}"),
            (None, _) => f.write_str(self.detail),
        }
    }
}

impl std::error::Error for AzureRequestError {}

/// The status and storage error code of an SDK error, when the service answered.
pub(crate) fn status_and_code(error: &azure_core::Error) -> Option<(u16, Option<&str>)> {
    match error.kind() {
        SdkErrorKind::HttpResponse {
            status, error_code, ..
        } => Some((u16::from(*status), error_code.as_deref())),
        _ => None,
    }
}

/// Codes saying the lease this client holds (or held) is no longer its own.
const LEASE_GONE_CODES: &[&str] = &[
    "LeaseIdMismatchWithLeaseOperation",
    "LeaseIdMismatchWithBlobOperation",
    "LeaseIsBrokenAndCannotBeRenewed",
    "LeaseNotPresentWithLeaseOperation",
    "LeaseNotPresentWithBlobOperation",
    "LeaseIdMissing",
    "LeaseLost",
    "LeaseIsBreakingAndCannotBeChanged",
];

/// Whether the answer says our lease is gone.
pub(crate) fn is_lease_gone(error: &azure_core::Error) -> bool {
    matches!(
        status_and_code(error),
        Some((409 | 412, Some(code))) if LEASE_GONE_CODES.contains(&code)
    )
}

/// Whether the answer is `code` with `status`.
pub(crate) fn is(error: &azure_core::Error, status: u16, code: &str) -> bool {
    status_and_code(error) == Some((status, Some(code)))
}

/// The backend error for a failed `operation` on a guard blob of `container`.
///
/// The container name is not a secret and names what an operator must create; the blob name
/// (the key) is never part of the message.
pub(crate) fn classify(
    container: &str,
    operation: &'static str,
    error: &azure_core::Error,
) -> BackendError {
    let (status, code) = match status_and_code(error) {
        Some((status, code)) => (Some(status), code.map(str::to_owned)),
        None => (None, None),
    };
    let detail = match error.kind() {
        SdkErrorKind::HttpResponse { .. } => "the service refused the request",
        SdkErrorKind::Connection => "could not connect",
        SdkErrorKind::Io => "the connection failed or timed out",
        SdkErrorKind::Credential => "the token credential could not get a token",
        SdkErrorKind::DataConversion => "the answer could not be read",
        _ => "the request failed",
    };
    let source = AzureRequestError {
        operation,
        status,
        error_code: code,
        detail,
    };
    let described = source.to_string();
    let backend = match (error.kind(), status) {
        (SdkErrorKind::Connection | SdkErrorKind::Io, _) => {
            BackendError::unreachable(format!("Azure Blob Storage did not answer ({described})"))
        }
        (SdkErrorKind::Credential, _) => BackendError::unreachable(format!(
            "no token for Azure Blob Storage ({described}); check the credential"
        )),
        (_, Some(401 | 403)) => BackendError::misconfigured(format!(
            "Azure Blob Storage refused the credentials or the permission ({described}); \
             check the account name and key, SAS or role assignment (Storage Blob Data \
             Contributor)"
        )),
        (_, Some(404)) if source.error_code() == Some("ContainerNotFound") => {
            BackendError::misconfigured(format!(
                "the container `{container}` does not exist in the storage account \
                 ({described}); create it, or call AzureBlobBackend::ensure_container in \
                 development"
            ))
        }
        // Azurite (and a custom BlobEndpoint whose path names another account) answers a
        // request for an account it does not have with a bare 404 ResourceNotFound: nothing
        // about the key or the container, so it can only be the account or endpoint.
        (_, Some(404)) if source.error_code() == Some("ResourceNotFound") => {
            BackendError::misconfigured(format!(
                "Azure Blob Storage has no such account at this endpoint ({described}); check \
                 AccountName and BlobEndpoint in the connection string, or service_url"
            ))
        }
        _ if is_lease_gone(error) => {
            BackendError::lease_gone(format!("the lease is gone ({described})"))
        }
        (_, Some(404)) if source.error_code() == Some("BlobNotFound") => {
            BackendError::lease_gone(format!("the guard blob is gone ({described})"))
        }
        (_, Some(408 | 429 | 500..=599)) => BackendError::transient(format!(
            "Azure Blob Storage failed temporarily ({described})"
        )),
        _ => BackendError::permanent(format!(
            "unexpected answer from Azure Blob Storage ({described})"
        )),
    };
    backend.with_source(source)
}

/// The backend error for a call that got no answer within the request timeout.
pub(crate) fn timed_out(operation: &'static str, timeout: Duration) -> BackendError {
    let source = AzureRequestError {
        operation,
        status: None,
        error_code: None,
        detail: "no answer within the request timeout",
    };
    BackendError::unreachable(format!(
        "Azure Blob Storage did not answer within {timeout:?} ({source})"
    ))
    .with_source(source)
}

/// A failure of ours, such as an unreadable fencing token.
pub(crate) fn unexpected(operation: &'static str, detail: &'static str) -> BackendError {
    let source = AzureRequestError {
        operation,
        status: None,
        error_code: None,
        detail,
    };
    BackendError::permanent(source.to_string()).with_source(source)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::BackendErrorKind;
    use azure_core::http::StatusCode;

    fn http(status: StatusCode, code: Option<&str>) -> azure_core::Error {
        azure_core::Error::with_message(
            SdkErrorKind::HttpResponse {
                status,
                error_code: code.map(str::to_owned),
                raw_response: None,
            },
            "http://127.0.0.1/devstoreaccount1/locks/customer-secret-key?sig=topsecret",
        )
    }

    fn kind(status: StatusCode, code: Option<&str>) -> BackendErrorKind {
        classify("locks", "op", &http(status, code)).kind()
    }

    #[test]
    fn lease_conflicts_mean_the_lease_is_gone() {
        for (status, code) in [
            (StatusCode::Conflict, "LeaseIdMismatchWithLeaseOperation"),
            (StatusCode::Conflict, "LeaseIsBrokenAndCannotBeRenewed"),
            (StatusCode::Conflict, "LeaseNotPresentWithLeaseOperation"),
            (
                StatusCode::PreconditionFailed,
                "LeaseIdMismatchWithBlobOperation",
            ),
            (StatusCode::PreconditionFailed, "LeaseIdMissing"),
            (StatusCode::PreconditionFailed, "LeaseLost"),
        ] {
            assert_eq!(
                kind(status, Some(code)),
                BackendErrorKind::LeaseGone,
                "{code}"
            );
        }
        assert_eq!(
            kind(StatusCode::NotFound, Some("BlobNotFound")),
            BackendErrorKind::LeaseGone
        );
    }

    #[test]
    fn refused_credentials_and_missing_containers_are_misconfiguration() {
        assert_eq!(
            kind(StatusCode::Forbidden, Some("AuthorizationFailure")),
            BackendErrorKind::Misconfigured
        );
        assert_eq!(
            kind(StatusCode::Unauthorized, None),
            BackendErrorKind::Misconfigured
        );
        assert_eq!(
            kind(StatusCode::NotFound, Some("ContainerNotFound")),
            BackendErrorKind::Misconfigured
        );
        assert_eq!(
            kind(StatusCode::NotFound, Some("ResourceNotFound")),
            BackendErrorKind::Misconfigured
        );
    }

    #[test]
    fn a_missing_container_is_named_and_a_missing_account_is_explained() {
        let container = classify(
            "job-locks",
            "acquire lease",
            &http(StatusCode::NotFound, Some("ContainerNotFound")),
        );
        assert!(
            container
                .message()
                .contains("the container `job-locks` does not exist"),
            "{container}"
        );
        let account = classify(
            "locks",
            "acquire lease",
            &http(StatusCode::NotFound, Some("ResourceNotFound")),
        );
        assert!(account.message().contains("AccountName"), "{account}");
        for error in [container, account] {
            assert!(!error.message().contains("customer-secret-key"), "{error}");
        }
    }

    #[test]
    fn server_trouble_is_transient_and_reached() {
        for status in [
            StatusCode::RequestTimeout,
            StatusCode::TooManyRequests,
            StatusCode::InternalServerError,
            StatusCode::ServiceUnavailable,
        ] {
            assert_eq!(
                kind(status, Some("ServerBusy")),
                BackendErrorKind::Transient { reached: true }
            );
        }
    }

    #[test]
    fn transport_failures_are_unreachable() {
        for sdk in [SdkErrorKind::Connection, SdkErrorKind::Io] {
            let error = azure_core::Error::with_message(sdk, "connection refused");
            assert_eq!(
                classify("locks", "op", &error).kind(),
                BackendErrorKind::Transient { reached: false }
            );
        }
        assert_eq!(
            timed_out("op", Duration::from_secs(5)).kind(),
            BackendErrorKind::Transient { reached: false }
        );
    }

    #[test]
    fn anything_else_is_permanent() {
        assert_eq!(
            kind(StatusCode::BadRequest, Some("InvalidHeaderValue")),
            BackendErrorKind::Permanent
        );
    }

    #[test]
    fn messages_keep_status_and_code_but_never_the_url() {
        let error = classify(
            "locks",
            "renew lease",
            &http(StatusCode::Conflict, Some("LeaseLost")),
        );
        let text = format!("{error} {error:?}");
        assert!(text.contains("renew lease: 409 LeaseLost"), "{text}");
        assert!(
            !text.contains("customer-secret-key") && !text.contains("topsecret"),
            "{text}"
        );
        let source = std::error::Error::source(&error)
            .and_then(|s| s.downcast_ref::<AzureRequestError>())
            .unwrap();
        assert_eq!(source.status(), Some(409));
        assert_eq!(source.error_code(), Some("LeaseLost"));
    }
}
