//! Shutdown signals.

/// Resolves on the first SIGTERM (Kubernetes pod termination) or SIGINT (Ctrl-C).
pub async fn signal() {
    let ctrl_c = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut stream) => {
                stream.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!(signal = "SIGINT", "shutdown requested"),
        () = terminate => tracing::info!(signal = "SIGTERM", "shutdown requested"),
    }
}

/// One shutdown for every front door of a process (a gRPC port beside an
/// HTTP one): each server waits on its own copy, all resolve together.
#[derive(Clone)]
pub struct Shared(tokio::sync::watch::Receiver<bool>);

impl Shared {
    /// Watches `shutdown` (e.g. [`signal`]) in a task of its own.
    pub fn new(shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop.send(true);
        });
        Self(stopped)
    }

    /// Resolves once the shutdown has come.
    pub fn wait(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut stopped = self.0.clone();
        async move {
            let _ = stopped.wait_for(|&stop| stop).await;
        }
    }
}
