//! A fake Kubernetes API server, since no real one can run here, on a
//! loopback port, with a kubeconfig file that points a client at it. It
//! serves two resources:
//!
//! - EndpointSlices for discovery, over the real list and watch protocol
//!   (`GET .../endpointslices?labelSelector=...` answers a list with its
//!   `resourceVersion`; `?watch=true&resourceVersion=N` streams the changes
//!   after N as newline-delimited `WatchEvent`s and stays open);
//! - Secrets for the chart's token hook: get, create (409 `AlreadyExists`
//!   when taken) and JSON merge patch (409 `Conflict` when the patch names a
//!   `resourceVersion` that is no longer current), with `Status` errors.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// The namespace the kubeconfig's context names (the client's default).
pub const NAMESPACE: &str = "sleuth";

#[derive(Default)]
struct Cluster {
    /// The last resourceVersion handed out.
    version: u64,
    /// Current slices by (namespace, name).
    slices: BTreeMap<(String, String), Value>,
    /// Every change: (resourceVersion, event type, namespace, object).
    history: Vec<(u64, &'static str, String, Value)>,
    /// Secrets by (namespace, name).
    secrets: BTreeMap<(String, String), Value>,
}

/// The fake API server; stops when dropped.
pub struct FakeKubeApi {
    cluster: Arc<Mutex<Cluster>>,
    changed: tokio::sync::watch::Sender<u64>,
    server: tokio::task::JoinHandle<()>,
    dir: tempfile::TempDir,
    /// `http://127.0.0.1:port`.
    pub url: String,
}

type Shared = (Arc<Mutex<Cluster>>, tokio::sync::watch::Receiver<u64>);

impl FakeKubeApi {
    /// Starts the server on a free loopback port and writes its kubeconfig.
    pub async fn start() -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let cluster = Arc::new(Mutex::new(Cluster::default()));
        let (changed, watching) = tokio::sync::watch::channel(0);
        let router = axum::Router::new()
            .route("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", axum::routing::get(slices))
            .route("/api/v1/namespaces/{namespace}/secrets", axum::routing::post(create_secret))
            .route("/api/v1/namespaces/{namespace}/secrets/{name}", axum::routing::get(get_secret).patch(patch_secret))
            .with_state((cluster.clone(), watching));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        let dir = tempfile::tempdir()?;
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {url}\n\
             contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {NAMESPACE}\n\
             current-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
        );
        std::fs::write(dir.path().join("kubeconfig"), kubeconfig)?;
        Ok(Self { cluster, changed, server, dir, url })
    }

    /// The kubeconfig file (for `KUBECONFIG`).
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// Creates or replaces the slice `name` of `service`: `endpoints` are
    /// (address, ready) on port `port` named `port_name`.
    pub fn set_slice(&self, service: &str, name: &str, port_name: &str, port: u16, endpoints: &[(&str, bool)]) {
        let object = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "labels": {"kubernetes.io/service-name": service},
            },
            "addressType": "IPv4",
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": endpoints.iter().map(|(address, ready)| json!({
                "addresses": [address],
                "conditions": {"ready": ready, "serving": ready, "terminating": !ready},
            })).collect::<Vec<_>>(),
        });
        let key = (NAMESPACE.to_owned(), name.to_owned());
        let kind = if self.cluster.lock().unwrap().slices.contains_key(&key) { "MODIFIED" } else { "ADDED" };
        self.record(kind, key, Some(object));
    }

    /// The Secret `name` in [`NAMESPACE`], as the server holds it.
    pub fn secret(&self, name: &str) -> Option<Value> {
        self.cluster.lock().unwrap().secrets.get(&(NAMESPACE.to_owned(), name.to_owned())).cloned()
    }

    /// Creates or replaces the Secret `name` in [`NAMESPACE`] with `data`
    /// (values as the API holds them: base64).
    pub fn set_secret(&self, name: &str, data: Value) {
        let mut cluster = self.cluster.lock().unwrap();
        cluster.version += 1;
        let object = json!({
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": data,
            "metadata": {"name": name, "namespace": NAMESPACE, "resourceVersion": cluster.version.to_string()},
        });
        cluster.secrets.insert((NAMESPACE.to_owned(), name.to_owned()), object);
    }

    /// Deletes the slice `name`.
    pub fn delete_slice(&self, name: &str) {
        self.record("DELETED", (NAMESPACE.to_owned(), name.to_owned()), None);
    }

    fn record(&self, kind: &'static str, key: (String, String), object: Option<Value>) {
        let mut cluster = self.cluster.lock().unwrap();
        cluster.version += 1;
        let version = cluster.version;
        let mut object = match object {
            Some(object) => object,
            None => match cluster.slices.get(&key) {
                Some(object) => object.clone(),
                None => return,
            },
        };
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        if kind == "DELETED" {
            cluster.slices.remove(&key);
        } else {
            cluster.slices.insert(key.clone(), object.clone());
        }
        cluster.history.push((version, kind, key.0, object));
        drop(cluster);
        let _ = self.changed.send(version);
    }
}

impl Drop for FakeKubeApi {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Whether `object`'s labels satisfy an equality `selector` (`k=v,k2=v2`).
fn selected(object: &Value, selector: Option<&str>) -> bool {
    selector.unwrap_or_default().split(',').filter(|s| !s.is_empty()).all(|term| match term.split_once('=') {
        Some((key, value)) => object["metadata"]["labels"][key.trim_end_matches('=')].as_str() == Some(value),
        None => false,
    })
}

async fn slices(
    State((cluster, mut changed)): State<Shared>,
    UrlPath(namespace): UrlPath<String>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Response {
    let selector = query.get("labelSelector").cloned();
    if query.get("watch").map(String::as_str) != Some("true") {
        let cluster = cluster.lock().unwrap();
        let items: Vec<&Value> = cluster
            .slices
            .iter()
            .filter(|((ns, _), object)| *ns == namespace && selected(object, selector.as_deref()))
            .map(|(_, object)| object)
            .collect();
        let list = json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSliceList",
            "metadata": {"resourceVersion": cluster.version.to_string()},
            "items": items,
        });
        return axum::Json(list).into_response();
    }
    let Some(mut after) = query.get("resourceVersion").and_then(|v| v.parse::<u64>().ok()) else {
        return (StatusCode::BAD_REQUEST, "a watch needs the resourceVersion of its list").into_response();
    };
    let timeout = query.get("timeoutSeconds").and_then(|t| t.parse().ok()).unwrap_or(290);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(timeout);
    let (lines, body) = tokio::sync::mpsc::channel::<Result<String, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        loop {
            let events: Vec<String> = {
                let cluster = cluster.lock().unwrap();
                let events = cluster
                    .history
                    .iter()
                    .filter(|(version, _, ns, object)| {
                        *version > after && *ns == namespace && selected(object, selector.as_deref())
                    })
                    .map(|(_, kind, _, object)| format!("{}\n", json!({"type": kind, "object": object})))
                    .collect();
                after = cluster.version;
                events
            };
            for event in events {
                if lines.send(Ok(event)).await.is_err() {
                    return;
                }
            }
            match tokio::time::timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                _ => return, // the watch's time is up (the client watches again), or the server stopped
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(body);
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A Kubernetes `Status` error, as clients parse it.
fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code.as_u16(),
    });
    (code, axum::Json(body)).into_response()
}

async fn get_secret(
    State((cluster, _)): State<Shared>,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
) -> Response {
    match cluster.lock().unwrap().secrets.get(&(namespace, name.clone())) {
        Some(secret) => axum::Json(secret.clone()).into_response(),
        None => status(StatusCode::NOT_FOUND, "NotFound", format!("secrets \"{name}\" not found")),
    }
}

async fn create_secret(
    State((cluster, _)): State<Shared>,
    UrlPath(namespace): UrlPath<String>,
    axum::Json(mut secret): axum::Json<Value>,
) -> Response {
    let Some(name) = secret["metadata"]["name"].as_str().map(str::to_owned) else {
        return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", "metadata.name: Required value".into());
    };
    let mut cluster = cluster.lock().unwrap();
    let key = (namespace.clone(), name.clone());
    if cluster.secrets.contains_key(&key) {
        return status(StatusCode::CONFLICT, "AlreadyExists", format!("secrets \"{name}\" already exists"));
    }
    cluster.version += 1;
    secret["metadata"]["namespace"] = json!(namespace);
    secret["metadata"]["resourceVersion"] = json!(cluster.version.to_string());
    cluster.secrets.insert(key, secret.clone());
    (StatusCode::CREATED, axum::Json(secret)).into_response()
}

/// A JSON merge patch (RFC 7386) of `data`; a
/// `metadata.resourceVersion` in the patch must be the current one.
async fn patch_secret(
    State((cluster, _)): State<Shared>,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    let Ok(patch) = serde_json::from_slice::<Value>(&body) else {
        return status(StatusCode::BAD_REQUEST, "BadRequest", "the patch is not JSON".into());
    };
    let mut cluster = cluster.lock().unwrap();
    let version = cluster.version + 1;
    let Some(secret) = cluster.secrets.get_mut(&(namespace, name.clone())) else {
        return status(StatusCode::NOT_FOUND, "NotFound", format!("secrets \"{name}\" not found"));
    };
    if let Some(expected) = patch["metadata"]["resourceVersion"].as_str()
        && secret["metadata"]["resourceVersion"].as_str() != Some(expected)
    {
        return status(
            StatusCode::CONFLICT,
            "Conflict",
            format!("Operation cannot be fulfilled on secrets \"{name}\": the object has been modified"),
        );
    }
    for (key, value) in patch["data"].as_object().into_iter().flatten() {
        if value.is_null() {
            secret["data"].as_object_mut().map(|data| data.remove(key));
        } else {
            secret["data"][key] = value.clone();
        }
    }
    secret["metadata"]["resourceVersion"] = json!(version.to_string());
    let patched = secret.clone();
    cluster.version = version;
    axum::Json(patched).into_response()
}

/// Waits until `ready` holds, polling every 20 ms, for at most `limit`.
pub async fn eventually(what: &str, limit: Duration, mut ready: impl FnMut() -> bool) -> Result<()> {
    let deadline = std::time::Instant::now() + limit;
    while !ready() {
        anyhow::ensure!(std::time::Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}
