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
use rustls::crypto::CryptoProvider;
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
            Arc::new(AnyHostName(chain))
        } else {
            chain
        }
    } else {
        Arc::new(EncryptOnly(provider.clone()))
    };
    Ok(MakeRustlsConnect::new(crate::tls::client_config(
        provider, verifier,
    )?))
}

/// Accepts any certificate but still checks the handshake signatures, so the session is
/// encrypted to whoever holds the certificate's key (libpq's `require`).
struct EncryptOnly(Arc<CryptoProvider>);

impl fmt::Debug for EncryptOnly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("EncryptOnly")
    }
}

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Checks the chain but not the host name (libpq's `verify-ca`).
#[derive(Debug)]
struct AnyHostName(Arc<dyn ServerCertVerifier>);

impl ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
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
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
