//! Objects copied to local files a chunk at a time: a model or checkpoint
//! fetched from S3 never sits whole in memory (a 1.7B model in bf16 is
//! 3.4 GB; reading it whole and copying it held two or three times that),
//! and a reader states how large it may be, so a wrong or hostile object
//! cannot fill the disk.

use std::path::Path;

use tokio::io::AsyncWriteExt;

use super::{ObjectStore, S3Args, check_key};
use crate::StoreError;

impl ObjectStore {
    /// Copies the object under `key` into the file `dest`, streamed, and
    /// returns its size; more than `limit` bytes (when given) is
    /// [`StoreError::TooLarge`], and leaves no file. The file appears only
    /// whole: it is written beside `dest` and renamed into place.
    pub async fn download(&self, key: &str, dest: &Path, limit: Option<u64>) -> Result<u64, StoreError> {
        check_key(key)?;
        let too_large = |limit| StoreError::TooLarge { store: self.uri(), key: key.to_owned(), limit };
        let mut partial = dest.as_os_str().to_owned();
        partial.push(".partial-download");
        let partial = std::path::PathBuf::from(partial);
        let written = match self {
            Self::Local { root } => {
                let source = root.join(key);
                let size = match tokio::fs::metadata(&source).await {
                    Ok(meta) => meta.len(),
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Err(self.not_found(key)),
                    Err(source) => return Err(self.io(source)),
                };
                if let Some(limit) = limit.filter(|&limit| size > limit) {
                    return Err(too_large(limit));
                }
                tokio::fs::copy(&source, &partial).await.map_err(|e| self.io(e))
            }
            Self::S3 { client, bucket, .. } => {
                let response = self.s3_get(client, bucket, key).await?;
                // Refused before a byte is read when the server says how large it is.
                if let Some(limit) = limit.filter(|&limit| response.content_length().is_some_and(|n| n as u64 > limit))
                {
                    return Err(too_large(limit));
                }
                let mut body = response.body;
                let mut file = tokio::fs::File::create(&partial).await.map_err(|e| self.io(e))?;
                let mut written = 0u64;
                let copied = async {
                    while let Some(chunk) = body.next().await {
                        let chunk = chunk.map_err(|error| StoreError::Object {
                            store: self.uri(),
                            message: format!("reading {key:?}: {error}"),
                        })?;
                        written += chunk.len() as u64;
                        if let Some(limit) = limit.filter(|&limit| written > limit) {
                            return Err(too_large(limit));
                        }
                        file.write_all(&chunk).await.map_err(|e| self.io(e))?;
                    }
                    file.sync_all().await.map_err(|e| self.io(e))
                };
                copied.await.map(|()| written)
            }
        };
        let renamed = match written {
            Ok(written) => tokio::fs::rename(&partial, dest).await.map(|()| written).map_err(|e| self.io(e)),
            Err(error) => Err(error),
        };
        if renamed.is_err() {
            let _ = tokio::fs::remove_file(&partial).await;
        }
        renamed
    }
}

/// Copies the top-level files of the HF model directory at `uri`
/// (`s3://bucket/prefix` or a local path: weights, config, tokenizer) into
/// `dir`, each streamed to disk, so it loads like a local one. A store
/// without `.safetensors` files is an error naming it, and so are files
/// that together exceed `limit` bytes (when given).
pub async fn fetch_model_dir(uri: &str, s3: &S3Args, dir: &Path, limit: Option<u64>) -> Result<(), StoreError> {
    let store = ObjectStore::open(uri, s3)?;
    let keys = store.list("").await?;
    let files: Vec<&String> = keys.iter().filter(|k| !k.contains('/')).collect();
    if !files.iter().any(|k| k.ends_with(".safetensors")) {
        return Err(StoreError::Object { store: store.uri(), message: "holds no .safetensors files".to_owned() });
    }
    let mut left = limit;
    for key in files {
        // Keys are data: only plain file names land in `dir` (never `..`).
        check_key(key)?;
        // Each file may take what the files before it left of the limit.
        let size = store.download(key, &dir.join(key), left).await?;
        left = left.map(|left| left - size);
    }
    Ok(())
}
