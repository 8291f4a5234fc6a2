//! Object storage for indexes and checkpoints: a local directory for one
//! machine, S3 (or any S3-compatible server) so Kubernetes pods can share
//! what a job built once.
//!
//! Keys are `/`-separated paths relative to the store's root (the directory,
//! or the bucket plus prefix of an `s3://bucket/prefix` URI).

use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use aws_config::default_provider::credentials::DefaultCredentialsChain;
use aws_credential_types::provider::{ProvideCredentials, future};
use aws_sdk_s3::config::{Region, RequestChecksumCalculation, ResponseChecksumValidation};
use aws_sdk_s3::primitives::ByteStream;
use futures::FutureExt;

use crate::StoreError;

mod fetch;
pub use fetch::fetch_model_dir;

/// The SDK's default credential chain, built on the first request: building
/// it reads profile files (async), while opening a store stays synchronous
/// and contacts nothing. The client caches what the chain returns and asks
/// again before it expires (web identity and container credentials rotate).
#[derive(Debug)]
struct DefaultChain {
    region: Region,
    chain: tokio::sync::OnceCell<DefaultCredentialsChain>,
}

impl ProvideCredentials for DefaultChain {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::new(async move {
            let chain =
                self.chain.get_or_init(|| DefaultCredentialsChain::builder().region(self.region.clone()).build()).await;
            chain.provide_credentials().await
        })
    }
}

/// Where S3 is and how to reach it. Credentials come from the AWS SDK's
/// default chain, in its order: the `AWS_ACCESS_KEY_ID` /
/// `AWS_SECRET_ACCESS_KEY` (/ `AWS_SESSION_TOKEN`) environment variables (a
/// Kubernetes Secret), shared config files, web identity
/// (`AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN`: EKS IRSA), container
/// credentials (`AWS_CONTAINER_CREDENTIALS_FULL_URI`: EKS Pod Identity), then
/// the instance profile.
#[derive(clap::Args, Debug, Clone)]
pub struct S3Args {
    /// S3 API endpoint for S3-compatible servers (MinIO, Ceph); unset = AWS.
    #[arg(long, env = "SLEUTH_S3_ENDPOINT")]
    pub s3_endpoint: Option<String>,
    /// Region of the bucket.
    #[arg(long, env = "SLEUTH_S3_REGION", default_value = "us-east-1")]
    pub s3_region: String,
    /// Deadline of each S3 request attempt (a multi-gigabyte shard must fit
    /// in it); a server that stops answering fails the request instead of
    /// hanging it.
    #[arg(long, env = "SLEUTH_S3_TIMEOUT", default_value = "10m", value_parser = humantime::parse_duration)]
    pub s3_timeout: std::time::Duration,
}

impl Default for S3Args {
    fn default() -> Self {
        Self { s3_endpoint: None, s3_region: "us-east-1".to_owned(), s3_timeout: std::time::Duration::from_secs(600) }
    }
}

/// A place to put and get blobs by key.
#[derive(Clone, Debug)]
pub enum ObjectStore {
    Local { root: PathBuf },
    S3 { client: aws_sdk_s3::Client, bucket: String, prefix: String },
}

impl ObjectStore {
    /// Opens `uri`: `s3://bucket[/prefix]` or a local directory path
    /// (optionally `file://`). Nothing is contacted yet.
    pub fn open(uri: &str, s3: &S3Args) -> Result<Self, StoreError> {
        let Some(rest) = uri.strip_prefix("s3://") else {
            let path = uri.strip_prefix("file://").unwrap_or(uri);
            if path.is_empty() {
                return Err(invalid(uri, "empty path"));
            }
            return Ok(Self::Local { root: PathBuf::from(path) });
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(invalid(uri, "missing bucket name after s3://"));
        }
        let region = Region::new(s3.s3_region.clone());
        let mut config = aws_sdk_s3::Config::builder()
            .behavior_version_latest()
            .region(region.clone())
            .credentials_provider(DefaultChain { region, chain: tokio::sync::OnceCell::new() })
            // Checksums only where S3 requires them: several S3-compatible
            // servers reject the newer default trailing checksums.
            .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
            .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
            .timeout_config(
                aws_sdk_s3::config::timeout::TimeoutConfig::builder()
                    .connect_timeout(std::time::Duration::from_secs(5))
                    .operation_attempt_timeout(s3.s3_timeout)
                    .build(),
            );
        if let Some(endpoint) = &s3.s3_endpoint {
            // S3-compatible servers rarely have wildcard DNS for virtual-hosted buckets.
            config = config.endpoint_url(endpoint).force_path_style(true);
        }
        Ok(Self::S3 {
            client: aws_sdk_s3::Client::from_conf(config.build()),
            bucket: bucket.to_owned(),
            prefix: prefix.trim_matches('/').to_owned(),
        })
    }

    /// The store as a URI, for messages.
    pub fn uri(&self) -> String {
        match self {
            Self::Local { root } => root.display().to_string(),
            Self::S3 { bucket, prefix, .. } if prefix.is_empty() => format!("s3://{bucket}"),
            Self::S3 { bucket, prefix, .. } => format!("s3://{bucket}/{prefix}"),
        }
    }

    /// Writes `bytes` under `key`. Readers never see a partial object: local
    /// files are written beside the target, fsynced and renamed into place,
    /// and the folder is fsynced, then each folder above it up to the root,
    /// so a written object survives a power cut, and so does a folder made
    /// for it (a new checkpoint step's: its entry lives in its parent).
    pub async fn put(&self, key: &str, bytes: Vec<u8>) -> Result<(), StoreError> {
        check_key(key)?;
        match self {
            Self::Local { root } => {
                let path = root.join(key);
                let tmp = path.with_extension(format!("partial-{}", std::process::id()));
                let result = async {
                    if let Some(parent) = path.parent() {
                        tokio::fs::create_dir_all(parent).await?;
                    }
                    let mut file = tokio::fs::File::create(&tmp).await?;
                    tokio::io::AsyncWriteExt::write_all(&mut file, &bytes).await?;
                    file.sync_all().await?;
                    drop(file);
                    // A crash here leaves only the partial file: readers see the old object or none.
                    sleuth_kit::fault::point("object-store.put.before-rename");
                    tokio::fs::rename(&tmp, &path).await?;
                    for folder in path.ancestors().skip(1) {
                        tokio::fs::File::open(folder).await?.sync_all().await?;
                        if folder == root.as_path() {
                            break;
                        }
                    }
                    Ok(())
                }
                .await;
                result.map_err(|source| self.io(source))
            }
            Self::S3 { client, bucket, .. } => client
                .put_object()
                .bucket(bucket)
                .key(self.s3_key(key))
                .body(ByteStream::from(bytes))
                .send()
                .await
                .map(drop)
                .map_err(|error| self.s3_error("put", key, error)),
        }
    }

    /// Reads the object under `key`.
    pub async fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        check_key(key)?;
        match self {
            Self::Local { root } => match tokio::fs::read(root.join(key)).await {
                Ok(bytes) => Ok(bytes),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => Err(self.not_found(key)),
                Err(source) => Err(self.io(source)),
            },
            Self::S3 { client, bucket, .. } => {
                let response = self.s3_get(client, bucket, key).await?;
                let body = response.body.collect().await.map_err(|error| StoreError::Object {
                    store: self.uri(),
                    message: format!("reading {key:?}: {error}"),
                })?;
                // No copy: the collected buffer becomes the Vec.
                Ok(Vec::from(body.into_bytes()))
            }
        }
    }

    /// Keys under `prefix` (a key prefix, `""` for all), sorted.
    pub async fn list(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        match self {
            Self::Local { root } => {
                let root = root.clone();
                let prefix = prefix.to_owned();
                let store = self.uri();
                tokio::task::spawn_blocking(move || list_local(&root, &prefix))
                    .await
                    .map_err(|error| StoreError::Object { store, message: error.to_string() })?
                    .map_err(|source| self.io(source))
            }
            Self::S3 { client, bucket, prefix: root, .. } => {
                let mut keys = Vec::new();
                let mut continuation = None;
                loop {
                    let page = client
                        .list_objects_v2()
                        .bucket(bucket)
                        .prefix(self.s3_key(prefix))
                        .set_continuation_token(continuation.take())
                        .send()
                        .await
                        .map_err(|error| self.s3_error("list", prefix, error))?;
                    let strip = if root.is_empty() { 0 } else { root.len() + 1 };
                    keys.extend(page.contents().iter().filter_map(|o| o.key()).map(|k| k[strip..].to_owned()));
                    match page.next_continuation_token() {
                        Some(token) if page.is_truncated() == Some(true) => continuation = Some(token.to_owned()),
                        _ => break,
                    }
                }
                keys.sort();
                Ok(keys)
            }
        }
    }

    /// Deletes `key`; deleting a missing key is not an error.
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        check_key(key)?;
        match self {
            Self::Local { root } => match tokio::fs::remove_file(root.join(key)).await {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(self.io(error)),
                _ => Ok(()),
            },
            Self::S3 { client, bucket, .. } => client
                .delete_object()
                .bucket(bucket)
                .key(self.s3_key(key))
                .send()
                .await
                .map(drop)
                .map_err(|error| self.s3_error("delete", key, error)),
        }
    }

    /// Deletes every object under the folder `dir` (a key prefix ending at a
    /// `/`); a missing folder is not an error.
    pub async fn delete_folder(&self, dir: &str) -> Result<(), StoreError> {
        check_key(dir)?;
        match self {
            Self::Local { root } => match tokio::fs::remove_dir_all(root.join(dir)).await {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(self.io(error)),
                _ => Ok(()),
            },
            Self::S3 { .. } => {
                for key in self.list(&format!("{}/", dir.trim_end_matches('/'))).await? {
                    self.delete(&key).await?;
                }
                Ok(())
            }
        }
    }

    /// Checks the store is reachable: the directory exists (or can be
    /// created), or the bucket answers.
    pub async fn check(&self) -> Result<(), StoreError> {
        match self {
            Self::Local { root } => tokio::fs::create_dir_all(root).await.map_err(|source| self.io(source)),
            Self::S3 { client, bucket, .. } => client
                .head_bucket()
                .bucket(bucket)
                .send()
                .await
                .map(drop)
                .map_err(|error| self.s3_error("head", "", error)),
        }
    }

    /// Readiness probe: the store is reachable.
    pub fn probe(&self) -> Arc<dyn sleuth_kit::Probe> {
        let store = self.clone();
        sleuth_kit::health::probe_fn("object-store", move || {
            let store = store.clone();
            async move { store.check().await.map_err(|error| error.to_string()) }.boxed()
        })
    }

    /// S3's answer to reading `key` (its body not read yet).
    async fn s3_get(
        &self,
        client: &aws_sdk_s3::Client,
        bucket: &str,
        key: &str,
    ) -> Result<aws_sdk_s3::operation::get_object::GetObjectOutput, StoreError> {
        client.get_object().bucket(bucket).key(self.s3_key(key)).send().await.map_err(|error| {
            if error.as_service_error().is_some_and(|e| e.is_no_such_key()) {
                self.not_found(key)
            } else {
                self.s3_error("get", key, error)
            }
        })
    }

    fn s3_key(&self, key: &str) -> String {
        match self {
            Self::S3 { prefix, .. } if !prefix.is_empty() => format!("{prefix}/{key}"),
            _ => key.to_owned(),
        }
    }

    fn io(&self, source: std::io::Error) -> StoreError {
        StoreError::Io { store: self.uri(), source }
    }

    fn not_found(&self, key: &str) -> StoreError {
        StoreError::ObjectNotFound { store: self.uri(), key: key.to_owned() }
    }

    fn s3_error<E, R>(&self, operation: &str, key: &str, error: aws_sdk_s3::error::SdkError<E, R>) -> StoreError
    where
        E: std::error::Error + Send + Sync + 'static,
        R: std::fmt::Debug,
    {
        let detail = aws_sdk_s3::error::DisplayErrorContext(&error);
        StoreError::Object { store: self.uri(), message: format!("{operation} {key:?}: {detail}") }
    }
}

fn invalid(uri: &str, message: &str) -> StoreError {
    StoreError::InvalidUrl { field: "object store uri", value: uri.to_owned(), message: message.to_owned() }
}

/// Keys must stay inside the store: relative, no `..`, no empty segments.
fn check_key(key: &str) -> Result<(), StoreError> {
    let path = Path::new(key);
    let inside = !key.is_empty()
        && !key.split('/').any(str::is_empty)
        && path.components().all(|c| matches!(c, Component::Normal(_)));
    if inside {
        Ok(())
    } else {
        Err(StoreError::InvalidUrl {
            field: "key",
            value: key.to_owned(),
            message: "must be a relative path without '..' or empty segments".to_owned(),
        })
    }
}

fn list_local(root: &Path, prefix: &str) -> std::io::Result<Vec<String>> {
    let mut keys = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
            Err(error) => return Err(error),
        };
        for entry in entries {
            let entry = entry?;
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                pending.push(path);
                continue;
            }
            let key = path.strip_prefix(root).expect("walked below root").to_string_lossy().replace('\\', "/");
            // In-progress writes are not objects yet.
            if key.starts_with(prefix) && !key.contains(".partial-") {
                keys.push(key);
            }
        }
    }
    keys.sort();
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_cannot_escape_the_store() {
        for bad in ["", "../etc/passwd", "/abs", "a//b", "a/../../b", "a/"] {
            assert!(check_key(bad).is_err(), "{bad:?} accepted");
        }
        check_key("checkpoints/step-10/shard-0.safetensors").unwrap();
    }

    #[test]
    fn s3_uri_without_bucket_is_rejected() {
        let error = ObjectStore::open("s3://", &S3Args::default()).unwrap_err().to_string();
        assert!(error.contains("missing bucket"), "{error}");
    }
}
