//! Shared Key authentication, which the GA Azure SDK for Rust does not provide
//! (Azure/azure-sdk-for-rust#2975).
//!
//! A per-try pipeline policy: each try (retries included) gets a fresh `x-ms-date` and a
//! signature over the request exactly as it will be sent, following
//! <https://learn.microsoft.com/rest/api/storageservices/authorize-with-shared-key>.

use std::fmt;
use std::sync::Arc;

use azure_core::http::policies::{Policy, PolicyResult};
use azure_core::http::{Context, Request};
use azure_core::time::{to_rfc7231, OffsetDateTime};
use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::config::SecretString;
use crate::error::{ErrorKind, LockError};

/// An SDK pipeline policy that signs every try of a request with a storage account key.
///
/// The lock backend installs it by itself for connection strings with an `AccountKey`. It is
/// public for your own SDK clients of the same account (the GA SDK has no Shared Key
/// support): add it to `ClientOptions::per_try_policies` and pass no token credential.
///
/// ```
/// use std::sync::Arc;
/// use lockingkit::config::SecretString;
/// use lockingkit::providers::azure::SharedKeyPolicy;
///
/// let key = SecretString::new("a2V5LWJ5dGVzLWZvci10ZXN0cw==");
/// let policy = SharedKeyPolicy::new("myaccount", &key)?;
/// let mut client_options = azure_core::http::ClientOptions::default();
/// client_options.per_try_policies.push(Arc::new(policy));
/// # Ok::<(), lockingkit::LockError>(())
/// ```
#[derive(Clone)]
pub struct SharedKeyPolicy {
    account: String,
    key: Arc<[u8]>,
}

impl SharedKeyPolicy {
    /// A policy for `account` with its base64 `account_key`.
    ///
    /// Fails with [`ErrorKind::Misconfigured`](crate::ErrorKind::Misconfigured) if the key is
    /// not base64; the error never contains the key.
    pub fn new(account: impl Into<String>, account_key: &SecretString) -> Result<Self, LockError> {
        match azure_core::base64::decode(account_key.expose().trim()) {
            Ok(key) if !key.is_empty() => Ok(Self::from_decoded(account.into(), key)),
            _ => Err(LockError::new(
                ErrorKind::Misconfigured,
                "the storage account key is not valid base64",
            )),
        }
    }

    pub(crate) fn from_decoded(account: String, key: Vec<u8>) -> Self {
        SharedKeyPolicy {
            account,
            key: key.into(),
        }
    }

    /// The `Authorization` header value for `request` as it stands, sent to `path`.
    fn authorization(&self, request: &Request, path: &str) -> String {
        let string_to_sign = string_to_sign(&self.account, request, path);
        // HMAC-SHA256 accepts keys of any length, so this cannot fail; the fallback only keeps
        // the code free of panics.
        let signature = match Hmac::<Sha256>::new_from_slice(&self.key) {
            Ok(mut mac) => {
                mac.update(string_to_sign.as_bytes());
                azure_core::base64::encode(mac.finalize().into_bytes())
            }
            Err(_) => String::new(),
        };
        format!("SharedKey {}:{signature}", self.account)
    }
}

impl fmt::Debug for SharedKeyPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedKeyPolicy")
            .field("account", &self.account)
            .field("key", &"[redacted]")
            .finish()
    }
}

#[async_trait::async_trait]
impl Policy for SharedKeyPolicy {
    async fn send(
        &self,
        ctx: &Context,
        request: &mut Request,
        next: &[Arc<dyn Policy>],
    ) -> PolicyResult {
        request.insert_header("x-ms-date", to_rfc7231(&OffsetDateTime::now_utc()));
        // A guard blob's request carries a placeholder name until the transport sends it;
        // the signature is for the path actually sent.
        let path = super::transport::GuardPath::for_request(ctx, request).to_owned();
        let authorization = self.authorization(request, &path);
        request.insert_header("authorization", authorization);
        match next.split_first() {
            Some((policy, rest)) => policy.send(ctx, request, rest).await,
            None => Err(azure_core::Error::with_message(
                azure_core::error::ErrorKind::Other,
                "the shared key policy must not be the last policy of a pipeline",
            )),
        }
    }
}

/// The Shared Key string to sign (service version 2015-02-21 and later): the verb and the
/// standard headers, the `x-ms-` headers, then the resource, each part on its own lines.
fn string_to_sign(account: &str, request: &Request, path: &str) -> String {
    let mut out = String::with_capacity(256);
    out.push_str(request.method().as_ref());
    out.push('\n');
    push_standard_headers(&mut out, request);
    push_ms_headers(&mut out, request);
    push_resource(&mut out, account, path, request.url());
    out
}

/// The standard headers Shared Key signs, in its order; the value of a header the request
/// lacks is an empty line. The third slot is `Content-Length`.
const STANDARD_HEADERS: [&str; 11] = [
    "content-encoding",
    "content-language",
    "content-length",
    "content-md5",
    "content-type",
    "date",
    "if-modified-since",
    "if-match",
    "if-none-match",
    "if-unmodified-since",
    "range",
];

/// One line per standard header, its value or nothing.
fn push_standard_headers(out: &mut String, request: &Request) {
    for name in STANDARD_HEADERS {
        if name == "content-length" {
            out.push_str(&content_length(request));
        } else {
            out.push_str(header(request, name));
        }
        out.push('\n');
    }
}

/// The value of the header `name` (ignoring case), or empty.
fn header<'a>(request: &'a Request, name: &str) -> &'a str {
    request
        .headers()
        .iter()
        .find(|(n, _)| n.as_str().eq_ignore_ascii_case(name))
        .map_or("", |(_, v)| v.as_str())
}

/// The signed `Content-Length`. A zero length is signed as empty; the transport sends an
/// explicit `Content-Length: 0` for bodiless PUTs, so the header (when set) and the body must
/// agree on this.
fn content_length(request: &Request) -> String {
    match header(request, "content-length") {
        "" | "0" => match request.body().len() {
            Some(0) | None => String::new(),
            Some(len) => len.to_string(),
        },
        explicit => explicit.to_owned(),
    }
}

/// Every `x-ms-` header as `name:value`, names lower-cased, sorted, one per line.
fn push_ms_headers(out: &mut String, request: &Request) {
    let mut ms_headers: Vec<(String, String)> = request
        .headers()
        .iter()
        .filter(|(name, _)| name.as_str().to_ascii_lowercase().starts_with("x-ms-"))
        .map(|(name, value)| {
            (
                name.as_str().to_ascii_lowercase(),
                collapse_whitespace(value.as_str()),
            )
        })
        .collect();
    ms_headers.sort();
    for (name, value) in ms_headers {
        out.push_str(&name);
        out.push(':');
        out.push_str(&value);
        out.push('\n');
    }
}

/// `/{account}{path}`, then each query parameter as `name:value1,value2`, names lower-cased
/// and sorted, on lines of their own.
fn push_resource(out: &mut String, account: &str, path: &str, url: &azure_core::http::Url) {
    // The resource is the path exactly as sent, still percent-encoded: the SDK encodes a blob
    // name as one segment (`orders/42` → `orders%2F42`), and the service signs that form.
    out.push('/');
    out.push_str(account);
    out.push_str(path);
    let mut params: Vec<(String, String)> = url
        .query_pairs()
        .map(|(name, value)| (name.to_lowercase(), value.into_owned()))
        .collect();
    params.sort();
    let mut index = 0;
    while index < params.len() {
        let name = &params[index].0;
        let mut values = Vec::new();
        let mut end = index;
        while end < params.len() && &params[end].0 == name {
            values.push(params[end].1.as_str());
            end += 1;
        }
        out.push('\n');
        out.push_str(name);
        out.push(':');
        out.push_str(&values.join(","));
        index = end;
    }
}

/// Header values are signed trimmed, with runs of whitespace folded to one space.
fn collapse_whitespace(value: &str) -> String {
    value.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use azure_core::http::{Method, Url};

    fn request(method: Method, url: &str) -> Request {
        Request::new(Url::parse(url).unwrap(), method)
    }

    #[test]
    fn lease_request_string_follows_the_shared_key_layout() {
        let mut req = request(
            Method::Put,
            "http://127.0.0.1:10000/devstoreaccount1/locks/orders%2F42?comp=lease",
        );
        req.insert_header("x-ms-version", "2026-02-06");
        req.insert_header("x-ms-lease-action", "acquire");
        req.insert_header("x-ms-date", "Mon, 01 Jan 2024 00:00:00 GMT");
        req.insert_header("x-ms-lease-duration", "30");
        let expected = "PUT\n\n\n\n\n\n\n\n\n\n\n\n\
            x-ms-date:Mon, 01 Jan 2024 00:00:00 GMT\n\
            x-ms-lease-action:acquire\n\
            x-ms-lease-duration:30\n\
            x-ms-version:2026-02-06\n\
            /devstoreaccount1/devstoreaccount1/locks/orders%2F42\ncomp:lease";
        assert_eq!(
            string_to_sign("devstoreaccount1", &req, req.url().path()),
            expected
        );
    }

    #[test]
    fn query_parameters_are_sorted_lowercased_and_decoded() {
        let req = request(
            Method::Get,
            "https://acct.blob.core.windows.net/locks?restype=container&comp=list&Prefix=a%2Fb",
        );
        let signed = string_to_sign("acct", &req, req.url().path());
        assert!(
            signed.ends_with("/acct/locks\ncomp:list\nprefix:a/b\nrestype:container"),
            "{signed}"
        );
    }

    #[test]
    fn a_zero_content_length_is_signed_as_empty() {
        let mut req = request(Method::Put, "http://h/acct/c/b");
        req.insert_header("content-length", "0");
        assert!(string_to_sign("acct", &req, req.url().path()).starts_with("PUT\n\n\n\n"));
        let mut with_body = request(Method::Put, "http://h/acct/c/b");
        with_body.set_body(azure_core::Bytes::from_static(b"12345"));
        assert!(
            string_to_sign("acct", &with_body, with_body.url().path()).starts_with("PUT\n\n\n5\n")
        );
    }

    #[test]
    fn conditional_headers_take_their_slots() {
        let mut req = request(Method::Put, "http://h/acct/c/b");
        req.insert_header("if-none-match", "*");
        req.insert_header("content-type", "application/octet-stream");
        let signed = string_to_sign("acct", &req, req.url().path());
        let lines: Vec<&str> = signed.split('\n').collect();
        assert_eq!(lines[5], "application/octet-stream");
        assert_eq!(lines[9], "*");
    }

    #[test]
    fn signature_is_the_base64_hmac_of_the_string() {
        let policy = SharedKeyPolicy::from_decoded("acct".into(), b"secret-key".to_vec());
        let mut req = request(Method::Head, "http://h/acct/c/b");
        req.insert_header("x-ms-date", "Mon, 01 Jan 2024 00:00:00 GMT");
        let mut mac = Hmac::<Sha256>::new_from_slice(b"secret-key").unwrap();
        mac.update(string_to_sign("acct", &req, req.url().path()).as_bytes());
        let expected = azure_core::base64::encode(mac.finalize().into_bytes());
        assert_eq!(
            policy.authorization(&req, req.url().path()),
            format!("SharedKey acct:{expected}")
        );
    }

    #[test]
    fn keys_that_are_not_base64_are_refused_without_echo() {
        let error = SharedKeyPolicy::new("acct", &SecretString::new("hunter2!")).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::Misconfigured);
        assert!(!error.to_string().contains("hunter2"));
        assert!(SharedKeyPolicy::new("acct", &SecretString::new("c2VjcmV0")).is_ok());
    }

    #[test]
    fn debug_redacts_the_key() {
        let policy = SharedKeyPolicy::from_decoded("acct".into(), b"secret-key".to_vec());
        let debug = format!("{policy:?}");
        assert!(
            debug.contains("acct") && !debug.contains("secret"),
            "{debug}"
        );
    }
}
