//! Certificate authorities for the TLS tests, made by each test that needs one. Invariant: every
//! file lives in the authority's own directory, removed when it is dropped; nothing is ever
//! added to the machine's trust store.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A CA, a server certificate it signed for `localhost` only (so that connecting by
/// `127.0.0.1` is a host name mismatch), and a client certificate it signed (CN `postgres`).
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    pub fn make(name: &str) -> Pki {
        let dir =
            std::env::temp_dir().join(format!("kfspki-{name}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("pki dir");
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, format!("kfs test CA {name}"));
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
        let write = |file: &str, text: String| std::fs::write(dir.join(file), text).unwrap();
        write("ca.pem", ca.pem());

        let mut server = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        server
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server_key = KeyPair::generate().unwrap();
        write(
            "server.pem",
            server.signed_by(&server_key, &ca).unwrap().pem(),
        );
        write("server.key", server_key.serialize_pem());

        let mut client = CertificateParams::new(Vec::<String>::new()).unwrap();
        client
            .distinguished_name
            .push(DnType::CommonName, "postgres");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate().unwrap();
        write(
            "client.pem",
            client.signed_by(&client_key, &ca).unwrap().pem(),
        );
        write("client.key", client_key.serialize_pem());
        Pki { dir }
    }

    pub fn file(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// Copies the server's files into `into` (a server's own directory).
    pub fn install_server_files(&self, into: &Path) {
        for f in ["ca.pem", "server.pem", "server.key"] {
            std::fs::copy(self.dir.join(f), into.join(f)).expect("copy a certificate file");
        }
        use std::os::unix::fs::PermissionsExt;
        // Postgres refuses a key that others may read.
        std::fs::set_permissions(
            into.join("server.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
