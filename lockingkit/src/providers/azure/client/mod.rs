//! How LockingKit reaches a storage account: the SDK plumbing under the lock protocol.
//!
//! The GA Azure SDK for Rust leaves three things to us, each in its own file: reading storage
//! connection strings ([`connection_string`]), signing requests with an account key
//! ([`shared_key`], which the SDK does not support), and an HTTP transport and retry policy
//! bounded for a lock client that must answer in time, which also keeps lock keys out of the
//! SDK's logs ([`transport`]). This module puts them together into the container client the
//! guard blobs are reached through. Nothing here knows about leases or fencing tokens.

use std::sync::Arc;

use azure_core::credentials::TokenCredential;
use azure_core::http::{ClientOptions, Url};
use azure_storage_blob::{BlobContainerClient, BlobContainerClientOptions};

use super::options::AzureBlobOptions;
use crate::config::Problem;

pub(crate) mod connection_string;
pub(crate) mod shared_key;
pub(crate) mod transport;

pub use shared_key::SharedKeyPolicy;
pub(crate) use transport::{GuardPath, PLACEHOLDER_BLOB};

use connection_string::{ConnectionString, Credential};

/// Parses a blob service URL: http or https, no query or fragment.
pub(crate) fn parse_service_url(text: &str) -> Result<Url, String> {
    let url = Url::parse(text.trim()).map_err(|_| "is not a valid URL".to_owned())?;
    if !matches!(url.scheme(), "http" | "https") || url.cannot_be_a_base() {
        return Err("must be an http or https URL".to_owned());
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("has no host".to_owned());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(
            "must not carry a query (give a SAS as SharedAccessSignature in a connection string)"
                .to_owned(),
        );
    }
    Ok(url)
}

fn container_url(service: &Url, container: &str) -> Url {
    let mut url = service.clone();
    if let Ok(mut segments) = url.path_segments_mut() {
        segments.pop_if_empty().push(container);
    }
    url
}

/// The container client for the account of a connection string whose options passed their
/// checks, or the problem that prevents it.
pub(crate) fn container_from_connection_string(
    options: &AzureBlobOptions,
) -> Result<BlobContainerClient, Problem> {
    let text = options
        .connection_string
        .as_ref()
        .map_or("", |text| text.expose());
    // Parsed by the options' checks already, so this does not fail; the problem only keeps
    // the code free of panics.
    let connection = ConnectionString::parse(text)
        .map_err(|_| Problem::new("connection_string", "is not usable"))?;
    let mut container_url = container_url(&connection.blob_endpoint, &options.container);
    let mut client_options = client_options(options)?;
    match connection.credential {
        Credential::SharedKey { account, key } => client_options
            .per_try_policies
            .push(Arc::new(SharedKeyPolicy::from_decoded(account, key))),
        Credential::Sas(sas) => container_url.set_query(Some(&sas)),
    }
    BlobContainerClient::new(container_url, None, Some(container_options(client_options)))
        .map_err(|_| Problem::of_section("the blob endpoint is not usable"))
}

/// The container client at a `service_url` whose options passed their checks, authenticated
/// with `credential`, or the problem that prevents it.
pub(crate) fn container_with_token(
    options: &AzureBlobOptions,
    credential: Arc<dyn TokenCredential>,
) -> Result<BlobContainerClient, Problem> {
    let url = options.service_url.as_deref().unwrap_or_default();
    let service_url =
        parse_service_url(url).map_err(|problem| Problem::detail("service_url", problem))?;
    if service_url.scheme() != "https" {
        return Err(Problem::new(
            "service_url",
            "must use https with a token credential",
        ));
    }
    let container_url = container_url(&service_url, &options.container);
    BlobContainerClient::new(
        container_url,
        Some(credential),
        Some(container_options(client_options(options)?)),
    )
    .map_err(|_| Problem::of_section("the blob endpoint is not usable"))
}

fn client_options(options: &AzureBlobOptions) -> Result<ClientOptions, Problem> {
    let transport = transport::transport(options.request_timeout)
        .map_err(|e| Problem::of_section(e.message()))?;
    Ok(ClientOptions {
        transport: Some(transport),
        retry: transport::QuickRetry::options(options.max_retries, options.retry_delay),
        ..Default::default()
    })
}

fn container_options(client_options: ClientOptions) -> BlobContainerClientOptions {
    BlobContainerClientOptions {
        client_options,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_urls_must_be_plain_http_or_https() {
        assert!(parse_service_url("https://acct.blob.core.windows.net").is_ok());
        assert!(parse_service_url("http://127.0.0.1:10000/devstoreaccount1").is_ok());
        assert!(parse_service_url("ftp://acct").is_err());
        assert!(parse_service_url("https://acct.blob.core.windows.net/?sig=x").is_err());
        assert!(parse_service_url("not a url").is_err());
    }

    #[test]
    fn the_container_is_appended_to_the_service_path() {
        let url = |s: &str| container_url(&Url::parse(s).unwrap(), "locks").to_string();
        assert_eq!(
            url("https://a.blob.core.windows.net"),
            "https://a.blob.core.windows.net/locks"
        );
        assert_eq!(
            url("http://127.0.0.1:1/devstoreaccount1/"),
            "http://127.0.0.1:1/devstoreaccount1/locks"
        );
    }
}
