//! A throwaway certificate authority, and Redis and PostgreSQL serving TLS
//! with a certificate it signed, to test the clients' TLS paths (`rediss://`,
//! `sslmode=verify-full`) as managed services use them. Keys and
//! certificates come from the `openssl` command (`make setup` installs it).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use tempfile::TempDir;

use crate::{TestServer, find_tool, spawn_with_free_port};

/// A certificate authority and one server certificate it signed, valid for
/// `localhost` and `127.0.0.1` for two days.
pub struct TestCa {
    dir: TempDir,
}

impl TestCa {
    /// Makes a new authority (its own key: two `TestCa`s never trust each
    /// other's servers) and a server certificate.
    pub fn new() -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("sleuth-ca-").tempdir()?;
        let openssl = |args: &[&str]| -> Result<()> {
            let output = Command::new(find_tool("openssl")?)
                .args(args)
                .current_dir(dir.path())
                .output()
                .context("running openssl")?;
            if !output.status.success() {
                bail!("openssl {} failed: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
            }
            Ok(())
        };
        let new_key = ["-newkey", "rsa:2048", "-nodes"];
        openssl(
            &[
                &["req", "-x509", "-days", "2"],
                &new_key[..],
                &["-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=sleuth-test-ca"],
            ]
            .concat(),
        )?;
        openssl(
            &[&["req"], &new_key[..], &["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]]
                .concat(),
        )?;
        std::fs::write(dir.path().join("server.ext"), "subjectAltName=DNS:localhost,IP:127.0.0.1\n")?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "server.ext",
            "-out",
            "server.pem",
        ])?;
        Ok(Self { dir })
    }

    /// The authority's certificate (PEM): what a client trusts.
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The server's certificate (PEM).
    pub fn server_cert(&self) -> PathBuf {
        self.dir.path().join("server.pem")
    }

    /// The server's private key (PEM, unencrypted).
    pub fn server_key(&self) -> PathBuf {
        self.dir.path().join("server.key")
    }
}

/// A Redis server that accepts TLS connections only, presenting `ca`'s server
/// certificate (clients need no certificate). URL: [`redis_tls_url`].
pub fn redis_tls(ca: &TestCa) -> Result<TestServer> {
    let binary = find_tool("redis-server")?;
    spawn_with_free_port("redis-tls", |port, dir| {
        let mut command = Command::new(&binary);
        command
            .args(["--bind", "127.0.0.1", "--port", "0", "--tls-port", &port.to_string(), "--save", ""])
            .args(["--appendonly", "no", "--tls-auth-clients", "no"])
            .arg("--tls-cert-file")
            .arg(ca.server_cert())
            .arg("--tls-key-file")
            .arg(ca.server_key())
            .arg("--tls-ca-cert-file")
            .arg(ca.ca_cert())
            .arg("--dir")
            .arg(dir);
        command
    })
}

/// `rediss://` for a [`redis_tls`] server.
pub fn redis_tls_url(server: &TestServer) -> String {
    format!("rediss://127.0.0.1:{}/0", server.port())
}

/// A PostgreSQL cluster with `ssl = on`, presenting `ca`'s server certificate;
/// it still accepts cleartext, as a managed server does until `require_secure_transport`.
pub fn postgres_tls(ca: &TestCa) -> Result<TestServer> {
    crate::postgres_with(Some(&|dir: &Path| -> Result<String> {
        // PostgreSQL refuses a key file others can read, and reads it as its own user.
        let (cert, key) = (dir.join("server.pem"), dir.join("server.key"));
        std::fs::copy(ca.server_cert(), &cert)?;
        std::fs::copy(ca.server_key(), &key)?;
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        Ok(format!("-c ssl=on -c ssl_cert_file={} -c ssl_key_file={}", cert.display(), key.display()))
    }))
}
