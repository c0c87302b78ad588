//! Storage connection strings: which blob endpoint, and how to authenticate to it.
//!
//! Errors name the offending setting, never its value: values carry account keys and SAS
//! signatures.

use std::fmt;

use azure_core::http::Url;

/// The account and key Azurite and the old storage emulator accept for
/// `UseDevelopmentStorage=true`. Public, documented values, not a secret.
const DEVELOPMENT_ACCOUNT: &str = "devstoreaccount1";
const DEVELOPMENT_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";
const DEVELOPMENT_ENDPOINT: &str = "http://127.0.0.1:10000/devstoreaccount1";

/// Settings a storage connection string may carry for services other than blobs; they are
/// accepted and ignored so a string copied from the portal works as is.
const OTHER_SERVICE_SETTINGS: &[&str] = &[
    "queueendpoint",
    "tableendpoint",
    "fileendpoint",
    "dfsendpoint",
    "queuesecondaryendpoint",
    "tablesecondaryendpoint",
    "filesecondaryendpoint",
    "blobsecondaryendpoint",
];

/// How requests to the account are authenticated.
#[derive(Clone, PartialEq, Eq)]
pub(crate) enum Credential {
    /// Shared Key: the account name and the decoded account key.
    SharedKey { account: String, key: Vec<u8> },
    /// A shared access signature appended to every request's query.
    Sas(String),
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credential::SharedKey { account, .. } => f
                .debug_struct("SharedKey")
                .field("account", account)
                .field("key", &"[redacted]")
                .finish(),
            Credential::Sas(_) => f.write_str("Sas([redacted])"),
        }
    }
}

/// A parsed connection string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ConnectionString {
    /// The blob service endpoint, without a query.
    pub(crate) blob_endpoint: Url,
    pub(crate) credential: Credential,
}

impl ConnectionString {
    /// Parses `text`, listing every problem found.
    pub(crate) fn parse(text: &str) -> Result<Self, Vec<String>> {
        let mut problems = Vec::new();
        let mut settings = Settings::default();
        for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((name, value)) = part.split_once('=') else {
                // The part may be a fragment of a secret: say where, not what.
                problems.push("a setting without `=` (expected Name=value pairs)".to_owned());
                continue;
            };
            let (name, value) = (name.trim(), value.trim());
            let slot = match name.to_ascii_lowercase().as_str() {
                "defaultendpointsprotocol" => &mut settings.protocol,
                "accountname" => &mut settings.account_name,
                "accountkey" => &mut settings.account_key,
                "endpointsuffix" => &mut settings.endpoint_suffix,
                "blobendpoint" => &mut settings.blob_endpoint,
                "sharedaccesssignature" => &mut settings.sas,
                "usedevelopmentstorage" => &mut settings.development,
                "developmentstorageproxyuri" => {
                    problems.push("DevelopmentStorageProxyUri is not supported".to_owned());
                    continue;
                }
                other if OTHER_SERVICE_SETTINGS.contains(&other) => continue,
                _ => {
                    problems.push(format!("unknown setting `{}`", printable(name)));
                    continue;
                }
            };
            if slot.replace(value.to_owned()).is_some() {
                problems.push(format!("`{}` is set twice", printable(name)));
            }
        }
        let parsed = settings.resolve(&mut problems);
        match parsed {
            Some(parsed) if problems.is_empty() => Ok(parsed),
            _ => {
                if problems.is_empty() {
                    problems.push("the connection string is incomplete".to_owned());
                }
                Err(problems)
            }
        }
    }
}

#[derive(Default)]
struct Settings {
    protocol: Option<String>,
    account_name: Option<String>,
    account_key: Option<String>,
    endpoint_suffix: Option<String>,
    blob_endpoint: Option<String>,
    sas: Option<String>,
    development: Option<String>,
}

impl Settings {
    /// The connection the settings describe, noting every problem found in `problems`.
    fn resolve(self, problems: &mut Vec<String>) -> Option<ConnectionString> {
        if let Some(development) = &self.development {
            return self.development_storage(development, problems);
        }
        let credential = self.credential(problems);
        let endpoint = self.blob_endpoint(problems);
        Some(ConnectionString {
            blob_endpoint: endpoint?,
            credential: credential?,
        })
    }

    /// `UseDevelopmentStorage=true`: the local emulator's documented account, alone.
    fn development_storage(
        &self,
        development: &str,
        problems: &mut Vec<String>,
    ) -> Option<ConnectionString> {
        if !development.eq_ignore_ascii_case("true") {
            problems.push("UseDevelopmentStorage must be `true` when present".to_owned());
            return None;
        }
        if self.account_name.is_some()
            || self.account_key.is_some()
            || self.blob_endpoint.is_some()
            || self.sas.is_some()
            || self.endpoint_suffix.is_some()
        {
            problems.push(
                "UseDevelopmentStorage=true cannot be combined with account or endpoint \
                 settings (give AccountName, AccountKey and BlobEndpoint instead)"
                    .to_owned(),
            );
            return None;
        }
        Some(ConnectionString {
            blob_endpoint: Url::parse(DEVELOPMENT_ENDPOINT).ok()?,
            credential: Credential::SharedKey {
                account: DEVELOPMENT_ACCOUNT.to_owned(),
                key: azure_core::base64::decode(DEVELOPMENT_KEY).ok()?,
            },
        })
    }

    /// The credential: an account key (with its account name) or a SAS, exactly one.
    fn credential(&self, problems: &mut Vec<String>) -> Option<Credential> {
        match (&self.account_key, &self.sas) {
            (Some(_), Some(_)) => {
                problems.push("set AccountKey or SharedAccessSignature, not both".to_owned());
                None
            }
            (Some(key), None) => self.shared_key(key, problems),
            (None, Some(sas)) => {
                let sas = sas.trim_start_matches('?');
                if sas.is_empty() {
                    problems.push("SharedAccessSignature is empty".to_owned());
                    None
                } else {
                    Some(Credential::Sas(sas.to_owned()))
                }
            }
            (None, None) => {
                problems.push(
                    "no credential: give AccountKey or SharedAccessSignature (or use \
                     service_url with a token credential)"
                        .to_owned(),
                );
                None
            }
        }
    }

    /// The Shared Key credential of `key`, which must be non-empty base64 and come with the
    /// account name it signs for.
    fn shared_key(&self, key: &str, problems: &mut Vec<String>) -> Option<Credential> {
        let Some(account) = &self.account_name else {
            problems.push("AccountKey needs AccountName".to_owned());
            return None;
        };
        if key.is_empty() {
            problems.push("AccountKey is empty".to_owned());
            return None;
        }
        match azure_core::base64::decode(key) {
            Ok(key) if !key.is_empty() => Some(Credential::SharedKey {
                account: account.clone(),
                key,
            }),
            _ => {
                problems.push("AccountKey is not valid base64".to_owned());
                None
            }
        }
    }

    /// The blob endpoint: `BlobEndpoint` as given, or made from the account name.
    fn blob_endpoint(&self, problems: &mut Vec<String>) -> Option<Url> {
        match (&self.blob_endpoint, &self.account_name) {
            // An explicit endpoint wins over DefaultEndpointsProtocol and EndpointSuffix, as in
            // the other Azure SDKs (Azurite's documented string carries both).
            (Some(endpoint), _) => match super::parse_service_url(endpoint) {
                Ok(url) => Some(url),
                Err(problem) => {
                    problems.push(format!("BlobEndpoint: {problem}"));
                    None
                }
            },
            (None, Some(account)) => self.account_endpoint(account, problems),
            (None, None) => {
                problems.push("give AccountName or BlobEndpoint".to_owned());
                None
            }
        }
    }

    /// `{protocol}://{account}.blob.{suffix}`, https and the public cloud by default.
    fn account_endpoint(&self, account: &str, problems: &mut Vec<String>) -> Option<Url> {
        let protocol = self.protocol.as_deref().unwrap_or("https");
        if !(protocol.eq_ignore_ascii_case("https") || protocol.eq_ignore_ascii_case("http")) {
            problems.push("DefaultEndpointsProtocol must be https or http".to_owned());
        }
        let suffix = self
            .endpoint_suffix
            .as_deref()
            .unwrap_or("core.windows.net");
        let is_dns_label = !account.is_empty()
            && account
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        if !is_dns_label {
            problems.push(
                "AccountName must be lowercase letters and digits (or give BlobEndpoint)"
                    .to_owned(),
            );
            return None;
        }
        let url = format!(
            "{}://{account}.blob.{}",
            protocol.to_ascii_lowercase(),
            suffix.trim_matches('.')
        );
        match super::parse_service_url(&url) {
            Ok(url) => Some(url),
            Err(_) => {
                problems.push("EndpointSuffix does not make a valid URL".to_owned());
                None
            }
        }
    }
}

/// A setting name safe to echo: names are not secret, but a mangled string could put a
/// secret where a name is expected, so anything unusual is cut short.
fn printable(name: &str) -> String {
    if name.len() <= 40 && name.bytes().all(|b| b.is_ascii_alphanumeric()) {
        name.to_owned()
    } else {
        "(unprintable)".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "a2V5LWJ5dGVzLWZvci10ZXN0cw=="; // base64 of "key-bytes-for-tests"

    fn shared_key(cs: &ConnectionString) -> (&str, &[u8]) {
        match &cs.credential {
            Credential::SharedKey { account, key } => (account, key),
            Credential::Sas(_) => panic!("expected a shared key"),
        }
    }

    #[test]
    fn account_name_and_key_make_the_public_cloud_endpoint() {
        let cs = ConnectionString::parse(&format!(
            "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={KEY};EndpointSuffix=core.windows.net"
        ))
        .unwrap();
        assert_eq!(
            cs.blob_endpoint.as_str(),
            "https://acct.blob.core.windows.net/"
        );
        assert_eq!(shared_key(&cs), ("acct", &b"key-bytes-for-tests"[..]));
    }

    #[test]
    fn endpoint_suffix_selects_a_sovereign_cloud() {
        let cs = ConnectionString::parse(&format!(
            "AccountName=acct;AccountKey={KEY};EndpointSuffix=core.chinacloudapi.cn"
        ))
        .unwrap();
        assert_eq!(
            cs.blob_endpoint.as_str(),
            "https://acct.blob.core.chinacloudapi.cn/"
        );
    }

    #[test]
    fn blob_endpoint_is_used_as_given() {
        let cs = ConnectionString::parse(&format!(
            "AccountName=devstoreaccount1;AccountKey={KEY};BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;"
        ))
        .unwrap();
        assert_eq!(
            cs.blob_endpoint.as_str(),
            "http://127.0.0.1:10000/devstoreaccount1"
        );
    }

    #[test]
    fn azurites_documented_connection_string_is_accepted() {
        let cs = ConnectionString::parse(&format!(
            "DefaultEndpointsProtocol=http;AccountName={DEVELOPMENT_ACCOUNT};AccountKey={DEVELOPMENT_KEY};\
             BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;"
        ))
        .unwrap();
        assert_eq!(cs.blob_endpoint.as_str(), DEVELOPMENT_ENDPOINT);
    }

    #[test]
    fn development_storage_is_the_local_emulator() {
        let cs = ConnectionString::parse("UseDevelopmentStorage=true").unwrap();
        assert_eq!(cs.blob_endpoint.as_str(), DEVELOPMENT_ENDPOINT);
        assert_eq!(shared_key(&cs).0, DEVELOPMENT_ACCOUNT);
        assert!(ConnectionString::parse("UseDevelopmentStorage=false").is_err());
        assert!(ConnectionString::parse("UseDevelopmentStorage=true;AccountName=x").is_err());
    }

    #[test]
    fn shared_access_signature_keeps_its_query_without_the_question_mark() {
        let cs = ConnectionString::parse(
            "BlobEndpoint=https://acct.blob.core.windows.net/;SharedAccessSignature=?sv=2024-11-04&sig=abc%3D",
        )
        .unwrap();
        assert_eq!(
            cs.credential,
            Credential::Sas("sv=2024-11-04&sig=abc%3D".into())
        );
    }

    #[test]
    fn setting_names_are_case_insensitive_and_values_may_contain_equals() {
        let cs = ConnectionString::parse(&format!("accountname=acct;ACCOUNTKEY={KEY}")).unwrap();
        assert_eq!(shared_key(&cs).1, b"key-bytes-for-tests");
    }

    #[test]
    fn other_services_endpoints_are_ignored() {
        let cs = ConnectionString::parse(&format!(
            "AccountName=acct;AccountKey={KEY};QueueEndpoint=https://acct.queue.core.windows.net/"
        ));
        assert!(cs.is_ok());
    }

    #[test]
    fn problems_are_listed_without_values() {
        let problems = ConnectionString::parse(
            "AccountName=acct;AccountKey=hunter2!!;SharedAccessSignature=sig=hunter3;Colour=blue",
        )
        .unwrap_err();
        let text = problems.join("\n");
        assert!(text.contains("unknown setting `Colour`"), "{text}");
        assert!(text.contains("not both"), "{text}");
        assert!(!text.contains("hunter") && !text.contains("blue"), "{text}");
    }

    #[test]
    fn incomplete_strings_say_what_is_missing() {
        let text = |s: &str| ConnectionString::parse(s).unwrap_err().join("\n");
        assert!(text("AccountName=acct").contains("no credential"));
        assert!(text(&format!("AccountKey={KEY}")).contains("AccountKey needs AccountName"));
        assert!(text("AccountName=acct;AccountKey=***").contains("not valid base64"));
        assert!(text("AccountName=acct;AccountKey=").contains("empty"));
        assert!(text("SharedAccessSignature=sv=1").contains("AccountName or BlobEndpoint"));
        assert!(text("BlobEndpoint=ftp://x;SharedAccessSignature=sv=1").contains("BlobEndpoint"));
        assert!(text("").contains("no credential"));
        assert!(text("junk").contains("without `=`"));
    }

    #[test]
    fn debug_never_shows_the_key_or_signature() {
        let cs = ConnectionString::parse(&format!("AccountName=acct;AccountKey={KEY}")).unwrap();
        assert!(!format!("{cs:?}").contains(KEY));
        let sas = Credential::Sas("sig=secret".into());
        assert!(!format!("{sas:?}").contains("secret"));
    }
}
