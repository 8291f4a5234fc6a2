//! Transport security: mutual TLS on every gRPC listener and every mesh
//! client, and TLS on the HTTP doors (the OpenAI-compatible API, the
//! dashboard), from PEM files that a Kubernetes Secret mounts.
//!
//! One process has one identity in the mesh, so the settings are installed
//! once per process ([`install`]) and every listener and client made after
//! that uses them; call sites keep passing only addresses and tokens.
//! Without settings everything stays cleartext, as before.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::error::KitError;

/// The mesh's TLS files. All three of certificate, key and CA, or none.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsArgs {
    /// PEM certificate (with its chain) this process presents: as the server
    /// of its listeners and as a client of the mesh's services (mutual TLS).
    #[arg(long, env = "SLEUTH_TLS_CERT", global = true)]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "SLEUTH_TLS_KEY", global = true)]
    pub tls_key: Option<PathBuf>,

    /// PEM certificates of the CA that signs the mesh's certificates: a
    /// client accepts only servers it signed, and a gRPC listener only
    /// clients it signed.
    #[arg(long, env = "SLEUTH_TLS_CA", global = true)]
    pub tls_ca: Option<PathBuf>,

    /// The name every mesh server's certificate is checked against, whatever
    /// address was dialled (policy servers and learner ranks are reached by
    /// pod IP). Unset: the host of the address.
    #[arg(long, env = "SLEUTH_TLS_SERVER_NAME", global = true)]
    pub tls_server_name: Option<String>,
}

/// A process's loaded TLS identity and trust.
pub struct MeshTls {
    args: TlsArgs,
    identity: Identity,
    ca: Certificate,
    /// For the HTTP doors: the same identity, no client certificate asked
    /// (browsers and OpenAI clients hold none; their tokens authenticate).
    http: Arc<tokio_rustls::rustls::ServerConfig>,
}

static INSTALLED: OnceLock<Option<MeshTls>> = OnceLock::new();

/// Loads `args` and makes them this process's TLS settings. A second call
/// with the same settings does nothing; with other settings it fails, since
/// listeners and clients already made use the first.
pub fn install(args: &TlsArgs) -> Result<(), KitError> {
    if let Some(installed) = INSTALLED.get() {
        let same = installed.as_ref().map(|tls| &tls.args).unwrap_or(&TlsArgs::default()) == args;
        return if same {
            Ok(())
        } else {
            Err(KitError::Config {
                field: "tls_cert",
                message: "this process already uses other TLS settings; one process has one identity".into(),
            })
        };
    }
    let loaded = MeshTls::load(args)?;
    // A race between two first calls: whichever lost compares as above.
    if INSTALLED.set(loaded).is_err() {
        return install(args);
    }
    Ok(())
}

/// The installed settings; `None` when the mesh is cleartext (or nothing was installed).
pub fn installed() -> Option<&'static MeshTls> {
    INSTALLED.get().and_then(Option::as_ref)
}

impl MeshTls {
    /// Reads and checks the files; `None` when no TLS setting is given.
    /// Errors name the setting and the file.
    pub fn load(args: &TlsArgs) -> Result<Option<Self>, KitError> {
        let (cert, key, ca) = match (&args.tls_cert, &args.tls_key, &args.tls_ca) {
            (None, None, None) => {
                if args.tls_server_name.is_some() {
                    return Err(missing("tls_cert", "SLEUTH_TLS_SERVER_NAME is set"));
                }
                return Ok(None);
            }
            (Some(cert), Some(key), Some(ca)) => (cert, key, ca),
            (None, ..) => return Err(missing("tls_cert", "SLEUTH_TLS_KEY or SLEUTH_TLS_CA is set")),
            (_, None, _) => return Err(missing("tls_key", "SLEUTH_TLS_CERT or SLEUTH_TLS_CA is set")),
            (_, _, None) => return Err(missing("tls_ca", "SLEUTH_TLS_CERT or SLEUTH_TLS_KEY is set")),
        };
        let (cert_pem, key_pem, ca_pem) = (read(cert, "tls_cert")?, read(key, "tls_key")?, read(ca, "tls_ca")?);
        let chain = parse_certificates(&cert_pem, cert, "tls_cert")?;
        parse_certificates(&ca_pem, ca, "tls_ca")?;
        use tokio_rustls::rustls::pki_types::{PrivateKeyDer, pem::PemObject};
        let private_key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|error| KitError::Config {
            field: "tls_key",
            message: format!("{}: no PEM private key: {error}", key.display()),
        })?;
        let http = tokio_rustls::rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(chain, private_key)
            .map_err(|error| KitError::Config {
                field: "tls_key",
                message: format!("{} does not go with {}: {error}", key.display(), cert.display()),
            })?;
        let mut http = http;
        // The HTTP doors speak HTTP/1.1 only.
        http.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Some(Self {
            args: args.clone(),
            identity: Identity::from_pem(cert_pem, key_pem),
            ca: Certificate::from_pem(ca_pem),
            http: Arc::new(http),
        }))
    }

    /// A gRPC listener's settings: this identity, and only clients the CA signed.
    pub fn grpc_server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity.clone()).client_ca_root(self.ca.clone())
    }

    /// A mesh client's settings: servers the CA signed, this identity presented.
    pub fn grpc_client(&self) -> ClientTlsConfig {
        let config = ClientTlsConfig::new().ca_certificate(self.ca.clone()).identity(self.identity.clone());
        match &self.args.tls_server_name {
            Some(name) => config.domain_name(name.clone()),
            None => config,
        }
    }
}

fn missing(field: &'static str, because: &str) -> KitError {
    KitError::Config {
        field,
        message: format!(
            "{because}: mutual TLS needs all of SLEUTH_TLS_CERT, SLEUTH_TLS_KEY and SLEUTH_TLS_CA (or none of them)"
        ),
    }
}

fn read(path: &Path, field: &'static str) -> Result<Vec<u8>, KitError> {
    std::fs::read(path)
        .map_err(|error| KitError::Config { field, message: format!("cannot read {}: {error}", path.display()) })
}

fn parse_certificates(
    pem: &[u8],
    path: &Path,
    field: &'static str,
) -> Result<Vec<tokio_rustls::rustls::pki_types::CertificateDer<'static>>, KitError> {
    use tokio_rustls::rustls::pki_types::{CertificateDer, pem::PemObject};
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| KitError::Config { field, message: format!("{}: {error}", path.display()) })?;
    if certificates.is_empty() {
        return Err(KitError::Config { field, message: format!("{} holds no PEM certificate", path.display()) });
    }
    Ok(certificates)
}

/// A TLS handshake that takes longer than this is dropped, so a client that
/// connects and says nothing holds no task for long.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown`, over TLS when settings are
/// installed (the HTTP doors: no client certificate is asked).
pub fn serve_http(
    listener: TcpListener,
    router: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> BoxFuture<'static, std::io::Result<()>> {
    match installed() {
        None => Box::pin(async move { axum::serve(listener, router).with_graceful_shutdown(shutdown).await }),
        Some(tls) => {
            let listener = TlsListener::new(listener, tls.http.clone());
            Box::pin(async move { axum::serve(listener, router).with_graceful_shutdown(shutdown).await })
        }
    }
}

/// Accepted TCP connections after their TLS handshake. Handshakes run in
/// tasks of their own, so a slow client never holds up the next accept.
struct TlsListener {
    handshaken: tokio::sync::mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
    local: std::io::Result<SocketAddr>,
    accepting: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    fn new(listener: TcpListener, config: Arc<tokio_rustls::rustls::ServerConfig>) -> Self {
        let local = listener.local_addr();
        let acceptor = tokio_rustls::TlsAcceptor::from(config);
        let (sender, handshaken) = tokio::sync::mpsc::channel(64);
        let accepting = tokio::spawn(async move {
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors and the like: wait, as axum does.
                        tracing::warn!(%error, "cannot accept an HTTP connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (acceptor, sender) = (acceptor.clone(), sender.clone());
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let _ = sender.send((stream, peer)).await;
                        }
                        Ok(Err(error)) => tracing::debug!(%peer, %error, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Self { handshaken, local, accepting }
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.handshaken.recv().await {
            Some(accepted) => accepted,
            // The accepting task only ends when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.local.as_ref().copied().map_err(|error| std::io::Error::new(error.kind(), error.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sleuth_testkit::tls::TestCa;

    fn args(ca: &TestCa) -> TlsArgs {
        TlsArgs {
            tls_cert: Some(ca.server_cert()),
            tls_key: Some(ca.server_key()),
            tls_ca: Some(ca.ca_cert()),
            tls_server_name: None,
        }
    }

    fn error(args: &TlsArgs) -> (&'static str, String) {
        match MeshTls::load(args) {
            Err(KitError::Config { field, message }) => (field, message),
            Err(other) => panic!("not a configuration error: {other}"),
            Ok(_) => panic!("{args:?} was accepted"),
        }
    }

    #[test]
    fn all_three_files_load_and_none_means_cleartext() {
        let ca = TestCa::new().unwrap();
        assert!(MeshTls::load(&args(&ca)).unwrap().is_some());
        assert!(MeshTls::load(&TlsArgs::default()).unwrap().is_none());
    }

    #[test]
    fn a_partial_setting_names_what_is_missing() {
        let ca = TestCa::new().unwrap();
        let (field, message) = error(&TlsArgs { tls_key: None, ..args(&ca) });
        assert_eq!(field, "tls_key", "{message}");
        assert!(message.contains("SLEUTH_TLS_KEY"), "{message}");
        assert_eq!(error(&TlsArgs { tls_ca: None, ..args(&ca) }).0, "tls_ca");
        assert_eq!(error(&TlsArgs { tls_cert: None, ..args(&ca) }).0, "tls_cert");
        let name_only = TlsArgs { tls_server_name: Some("mesh".into()), ..TlsArgs::default() };
        assert_eq!(error(&name_only).0, "tls_cert");
    }

    #[test]
    fn unreadable_unparsable_and_mismatched_files_are_named() {
        let ca = TestCa::new().unwrap();
        let other = TestCa::new().unwrap();
        let missing = ca.ca_cert().with_file_name("nowhere.pem");
        let (field, message) = error(&TlsArgs { tls_ca: Some(missing.clone()), ..args(&ca) });
        assert_eq!(field, "tls_ca");
        assert!(message.contains(&missing.display().to_string()), "{message}");
        // A key where the certificate belongs holds no certificate.
        let (field, message) = error(&TlsArgs { tls_cert: Some(ca.server_key()), ..args(&ca) });
        assert_eq!(field, "tls_cert", "{message}");
        // Another authority's key does not go with this certificate.
        let (field, message) = error(&TlsArgs { tls_key: Some(other.server_key()), ..args(&ca) });
        assert_eq!(field, "tls_key", "{message}");
        assert!(message.contains("does not go with"), "{message}");
    }
}
