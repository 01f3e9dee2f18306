//! TLS for every HTTP client: one configuration per process, whose root
//! certificates are read from the system at the first TLS handshake, not
//! when a client is made. A run against `http://` engines reads none (each
//! client once read the system's 140-odd certificate files, three clients
//! an endpoint: a one-item run took 35 to 44 ms with them, 27 to 29 ms
//! without), and a machine
//! without CA certificates (a slim container) still reaches them; an
//! `https://` endpoint there fails its handshake with a message that says
//! why.

use std::sync::{Arc, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// The TLS configuration of every client (cheap to clone: its parts are
/// shared), with its own crypto provider (ring): reqwest, handed it, needs
/// no process-wide default.
pub(super) fn config() -> rustls::ClientConfig {
    static CONFIG: OnceLock<rustls::ClientConfig> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                // The ring provider supports the default versions.
                .unwrap_or_else(|err| unreachable!("TLS versions: {err}"))
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(SystemRoots::new(provider)))
                .with_no_client_auth();
            // As reqwest asks for itself, built without HTTP/2.
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            config
        })
        .clone()
}

/// Verifies servers with the system's verifier (its root certificates and
/// WebPKI), made at the first handshake that needs it.
#[derive(Debug)]
struct SystemRoots {
    provider: Arc<CryptoProvider>,
    verifier: OnceLock<Result<rustls_platform_verifier::Verifier, rustls::Error>>,
}

impl SystemRoots {
    fn new(provider: Arc<CryptoProvider>) -> Self {
        Self {
            provider,
            verifier: OnceLock::new(),
        }
    }

    /// The system's verifier, or why there is none (said at every
    /// handshake: a certificate installed later needs a new process).
    fn verifier(&self) -> Result<&rustls_platform_verifier::Verifier, rustls::Error> {
        self.verifier
            .get_or_init(|| {
                rustls_platform_verifier::Verifier::new(self.provider.clone()).map_err(|err| {
                    let why = match err {
                        rustls::Error::General(why) => why,
                        other => other.to_string(),
                    };
                    rustls::Error::General(format!(
                        "the system's CA certificates cannot be read ({why}); install them \
                         (Debian: ca-certificates) or set SSL_CERT_FILE or SSL_CERT_DIR to them"
                    ))
                })
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

impl ServerCertVerifier for SystemRoots {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.verifier()?.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier()?.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier()?.verify_tls13_signature(message, cert, dss)
    }

    /// The provider's schemes, as the system's verifier gives them: known
    /// before any certificate is read.
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The verifier of every client still verifies: a certificate no root
    /// signed (a self-signed one for evalfleet-test.invalid, made with `openssl req
    /// -x509`) is refused, as the system's verifier refuses it.
    #[test]
    fn a_certificate_no_root_signed_is_refused() {
        let roots = SystemRoots::new(Arc::new(rustls::crypto::ring::default_provider()));
        let cert = CertificateDer::from(&include_bytes!("testdata/self-signed.der")[..]);
        let name = ServerName::try_from("evalfleet-test.invalid").unwrap();
        // A time within the certificate's validity (from 2026-12-07, for a
        // hundred years), whatever the machine's clock says.
        let during = UnixTime::since_unix_epoch(std::time::Duration::from_secs(1_900_000_000));
        let verdict = roots.verify_server_cert(&cert, &[], &name, &[], during);
        match verdict {
            Err(rustls::Error::InvalidCertificate(why)) => {
                assert_eq!(why, rustls::CertificateError::UnknownIssuer);
            }
            // A machine without CA certificates refuses every server.
            Err(rustls::Error::General(why)) => {
                assert!(why.contains("CA certificates cannot be read"), "{why}");
            }
            other => panic!("a self-signed certificate was not refused: {other:?}"),
        }
        // The signature schemes are the provider's, known without roots.
        assert!(!roots.supported_verify_schemes().is_empty());
    }
}
