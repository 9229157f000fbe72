//! Why a TLS handshake with Postgres or RabbitMQ failed, in words an operator can act on.
//! Invariant: a cause is read only from an error's messages (its own and its sources'), which
//! the TLS stack writes without URLs or key material; an error that is not about TLS has no
//! cause, and the caller reports it as before. [`client_cert_required`] only listens: it sends
//! nothing over its connection but a handshake.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};

/// The failures an operator can fix, each with what to change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The server's certificate does not chain to a CA the client trusts.
    UnknownCa,
    /// The certificate is valid, but not for the host name connected to.
    HostMismatch,
    /// The certificate has expired or is not valid yet.
    NotValidNow,
    /// The server wants a client certificate and got none.
    ClientCertRequired,
    /// The server rejected the client certificate it got.
    ClientCertRejected,
    /// The server does not offer TLS at all (Postgres answered the TLS request with "no").
    ServerWithoutTls,
    /// The bytes that came back were not TLS: a plain listener on that port.
    NotTls,
}

impl Cause {
    /// What went wrong and what to do, for a service whose CA and client certificate settings
    /// are named `ca` and `cert`.
    pub fn explain(self, ca: &str, cert: &str) -> String {
        match self {
            Cause::UnknownCa => format!(
                "the server's certificate is not signed by a CA this client trusts (unknown CA); give the CA that signed it with {ca}"
            ),
            Cause::HostMismatch => "the server's certificate is not valid for the host name in the URL (host name mismatch); connect by a name the certificate lists".into(),
            Cause::NotValidNow => "the server's certificate has expired or is not valid yet".into(),
            Cause::ClientCertRequired => format!(
                "the server requires a client certificate and none was given (no certificate); set {cert}"
            ),
            Cause::ClientCertRejected => format!(
                "the server rejected the client certificate of {cert} (not signed by a CA it trusts, or expired)"
            ),
            Cause::ServerWithoutTls => "the server does not offer TLS (it runs without ssl); turn TLS on there, or lower the sslmode".into(),
            Cause::NotTls => "the server did not answer with TLS; is that port a TLS listener?".into(),
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// The cause of `e`, looked for in its message and its sources' messages.
pub fn cause(e: &(dyn std::error::Error + 'static)) -> Option<Cause> {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(c) = cause_in(&err.to_string()).or_else(|| cause_in(&format!("{err:?}"))) {
            return Some(c);
        }
        next = err.source();
    }
    None
}

/// The cause a TLS stack's message names, if any. Pure: the table test pins the messages of
/// rustls, sqlx and the servers.
pub fn cause_in(text: &str) -> Option<Cause> {
    let t = text.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| t.contains(n));
    if has(&["unknownissuer", "unknown issuer", "unknownca", "unknown ca"]) {
        Some(Cause::UnknownCa)
    } else if has(&["notvalidforname", "not valid for name"]) {
        Some(Cause::HostMismatch)
    } else if t.contains("certificate") && has(&["expired", "notvalidyet", "not valid yet"]) {
        Some(Cause::NotValidNow)
    } else if has(&[
        "certificaterequired",
        "certificate required",
        "requires a valid client certificate",
        "peer sent no certificates",
    ]) {
        Some(Cause::ClientCertRequired)
    } else if has(&["badcertificate", "bad certificate", "certificateunknown"]) {
        Some(Cause::ClientCertRejected)
    } else if has(&["server does not support tls"]) {
        Some(Cause::ServerWithoutTls)
    } else if has(&[
        "received corrupt message",
        "invalidcontenttype",
        "record overflow",
        "wrong version number",
    ]) {
        Some(Cause::NotTls)
    } else {
        None
    }
}

/// Whether the TLS server at `host:port` refuses a client without a certificate: a handshake
/// with none, then listening (sending nothing) for the server's alert within `within`. The
/// server's certificate is not checked, as nothing is sent over this connection but the
/// handshake: no credentials, no data.
pub async fn client_cert_required(host: &str, port: u16, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let listen = async {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .ok()?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyServer(provider)))
            .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect((host, port)).await.ok()?;
        let name = ServerName::try_from(host.to_owned()).ok()?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let mut tls = match connector.connect(name, tcp).await {
            Ok(tls) => tls,
            // TLS 1.2 refuses during the handshake itself.
            Err(e) => return Some(cause(&e) == Some(Cause::ClientCertRequired)),
        };
        let mut byte = [0u8; 1];
        match tls.read(&mut byte).await {
            Err(e) => Some(cause(&e) == Some(Cause::ClientCertRequired)),
            Ok(_) => Some(false),
        }
    };
    matches!(tokio::time::timeout(within, listen).await, Ok(Some(true)))
}

/// Accepts any server certificate: only for [`client_cert_required`], which sends nothing.
#[derive(Debug)]
struct AnyServer(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_of_the_tls_stacks_name_their_cause() {
        let table: &[(&str, Option<Cause>)] = &[
            (
                "invalid peer certificate: UnknownIssuer",
                Some(Cause::UnknownCa),
            ),
            (
                "invalid peer certificate: certificate not valid for name \"db.example\"; certificate is only valid for DnsName(\"localhost\")",
                Some(Cause::HostMismatch),
            ),
            ("invalid peer certificate: NotValidForName", Some(Cause::HostMismatch)),
            (
                "invalid peer certificate: certificate expired: verification time 1, but certificate is not valid after 0",
                Some(Cause::NotValidNow),
            ),
            (
                "received fatal alert: CertificateRequired",
                Some(Cause::ClientCertRequired),
            ),
            (
                "connection requires a valid client certificate",
                Some(Cause::ClientCertRequired),
            ),
            ("received fatal alert: BadCertificate", Some(Cause::ClientCertRejected)),
            ("received fatal alert: UnknownCA", Some(Cause::UnknownCa)),
            ("server does not support TLS", Some(Cause::ServerWithoutTls)),
            (
                "received corrupt message of type InvalidContentType",
                Some(Cause::NotTls),
            ),
            ("connection refused", None),
            ("password authentication failed for user \"kfs\"", None),
        ];
        for (text, want) in table {
            assert_eq!(cause_in(text), *want, "{text}");
        }
    }

    #[test]
    fn the_cause_is_found_in_an_errors_sources() {
        let inner = std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "invalid peer certificate: UnknownIssuer",
        );
        let outer = std::io::Error::other(inner);
        assert_eq!(cause(&outer), Some(Cause::UnknownCa));
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(cause(&plain), None);
    }

    #[test]
    fn every_explanation_names_what_to_set() {
        let ca = Cause::UnknownCa.explain("sslrootcert", "sslcert");
        assert!(
            ca.contains("sslrootcert") && ca.contains("unknown CA"),
            "{ca}"
        );
        let cert = Cause::ClientCertRequired.explain("KFS_AMQP_TLS_CA", "KFS_AMQP_TLS_CERT");
        assert!(cert.contains("KFS_AMQP_TLS_CERT"), "{cert}");
        assert!(Cause::HostMismatch
            .explain("", "")
            .contains("host name mismatch"));
    }
}
