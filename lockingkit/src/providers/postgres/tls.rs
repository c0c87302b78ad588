//! TLS for PostgreSQL connections, with libpq's `sslmode` meanings.
//!
//! `prefer` and `require` encrypt without checking who answers, exactly as libpq does, because
//! connection strings copied from hosting portals say `sslmode=require` and expect it to work
//! with the provider's private CA. `verify-ca` and `verify-full` check the chain against the
//! roots in `sslrootcert` when given (and only those, as libpq does), otherwise against the
//! platform's trust store; `verify-full` also checks the host name.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::connection::{ConnectionSettings, SslMode};

/// The TLS connector for `settings`; the error is a configuration problem for humans.
pub(super) fn connector(settings: &ConnectionSettings) -> Result<MakeRustlsConnect, String> {
    let provider = crate::tls::provider();
    let verifier: Arc<dyn ServerCertVerifier> = if settings.ssl_mode.verifies() {
        let chain =
            crate::tls::verifier(&provider, settings.root_cert.as_deref()).map_err(|problem| {
                match settings.root_cert {
                    Some(_) => format!("sslrootcert {problem}"),
                    None => format!("sslmode verifies certificates but {problem}; set sslrootcert"),
                }
            })?;
        if settings.ssl_mode == SslMode::VerifyCa {
            Arc::new(Lenient::any_host_name(chain, &provider))
        } else {
            chain
        }
    } else {
        Arc::new(Lenient::encrypt_only(&provider))
    };
    Ok(MakeRustlsConnect::new(crate::tls::client_config(
        provider, verifier,
    )?))
}

/// What libpq's lenient modes accept, with the handshake signatures still checked (by the chain
/// check's verifier where there is one, else by the provider's algorithms), so the session is
/// encrypted to whoever holds the certificate's key.
struct Lenient {
    /// The chain check whose host-name verdict is ignored (libpq's `verify-ca`), or `None` to
    /// accept any certificate (libpq's `require`).
    chain: Option<Arc<dyn ServerCertVerifier>>,
    /// The signature algorithms the handshake is checked with when there is no chain check.
    algorithms: WebPkiSupportedAlgorithms,
}

impl Lenient {
    /// Accepts any certificate (libpq's `require`).
    fn encrypt_only(provider: &CryptoProvider) -> Self {
        Lenient {
            chain: None,
            algorithms: provider.signature_verification_algorithms,
        }
    }

    /// Checks the chain with `chain` but not the host name (libpq's `verify-ca`).
    fn any_host_name(chain: Arc<dyn ServerCertVerifier>, provider: &CryptoProvider) -> Self {
        Lenient {
            chain: Some(chain),
            algorithms: provider.signature_verification_algorithms,
        }
    }
}

impl fmt::Debug for Lenient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lenient")
            .field("chain", &self.chain)
            .finish_non_exhaustive()
    }
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        match &self.chain {
            Some(chain) => chain.verify_tls12_signature(message, cert, dss),
            None => rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms),
        }
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        match &self.chain {
            Some(chain) => chain.verify_tls13_signature(message, cert, dss),
            None => rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms),
        }
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        match &self.chain {
            Some(chain) => chain.supported_verify_schemes(),
            None => self.algorithms.supported_schemes(),
        }
    }
}
