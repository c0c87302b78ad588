//! TLS for the providers that open their own sockets (PostgreSQL, Redis): rustls on ring, with
//! server certificates checked against the platform's trust store, or against the roots of a PEM
//! file when one is named (and then only those).

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::ServerCertVerifier;
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::ClientConfig;

/// The cryptography every TLS connection uses: ring, which builds in a fraction of aws-lc's time.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A verifier of the chain and the host name: against the roots in `root_cert` when given,
/// otherwise against the platform's trust store. A problem reads as the rest of a sentence about
/// the setting that names the file (`cannot be read (…)`), or, without a file, about the
/// platform (`the platform has no usable trust store (…)`); it never quotes more than the library
/// says.
pub(crate) fn verifier(
    provider: &Arc<CryptoProvider>,
    root_cert: Option<&Path>,
) -> Result<Arc<dyn ServerCertVerifier>, String> {
    match root_cert {
        Some(path) => {
            let roots = load_roots(path)?;
            let verifier =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| format!("cannot be used ({e})"))?;
            Ok(verifier)
        }
        None => {
            let verifier = rustls_platform_verifier::Verifier::new(provider.clone())
                .map_err(|e| format!("the platform has no usable trust store ({e})"))?;
            Ok(Arc::new(verifier))
        }
    }
}

/// A client configuration (safe protocol versions, no client certificate) that checks servers
/// with `verifier`.
pub(crate) fn client_config(
    provider: Arc<CryptoProvider>,
    verifier: Arc<dyn ServerCertVerifier>,
) -> Result<ClientConfig, String> {
    Ok(ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS cannot be set up ({e})"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

/// The certificates of the PEM file at `path`, as trust roots.
fn load_roots(path: &Path) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    let certificates =
        CertificateDer::pem_file_iter(path).map_err(|e| format!("cannot be read ({e})"))?;
    for certificate in certificates {
        let certificate =
            certificate.map_err(|e| format!("is not a PEM certificate file ({e})"))?;
        roots
            .add(certificate)
            .map_err(|e| format!("holds an unusable certificate ({e})"))?;
    }
    if roots.is_empty() {
        return Err("holds no certificate".to_owned());
    }
    Ok(roots)
}
