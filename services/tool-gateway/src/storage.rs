//! Moving collections between object storage and local disk: BEIR sources to
//! index, prebuilt indexes to serve, and indexes to publish.

use std::path::{Path, PathBuf};

use sleuth_store::{ObjectStore, S3Args};
use tempfile::TempDir;

use crate::collection::Collection;
use crate::error::Error;

/// A BEIR directory ready to read: local, or downloaded from S3 into a scratch directory.
pub enum BeirSource {
    Local(PathBuf),
    Downloaded(TempDir),
}

impl BeirSource {
    pub fn path(&self) -> &Path {
        match self {
            BeirSource::Local(path) => path,
            BeirSource::Downloaded(dir) => dir.path(),
        }
    }
}

/// Makes the BEIR collection at `uri` readable locally.
pub async fn fetch_beir(uri: &str, scratch_root: &Path, s3: &S3Args) -> Result<BeirSource, Error> {
    if uri.trim().is_empty() {
        return Err(Error::InvalidArgument("source_uri must not be empty".to_owned()));
    }
    match ObjectStore::open(uri, s3)? {
        ObjectStore::Local { root } => {
            if !root.join("corpus.jsonl").is_file() {
                return Err(Error::NotFound(format!("source_uri {uri:?} has no corpus.jsonl")));
            }
            Ok(BeirSource::Local(root))
        }
        store => {
            std::fs::create_dir_all(scratch_root).map_err(|e| Error::io(scratch_root, e))?;
            let scratch = tempfile::Builder::new()
                .prefix(".source-")
                .tempdir_in(scratch_root)
                .map_err(|e| Error::io(scratch_root, e))?;
            let copied = download(&store, scratch.path()).await?;
            if !scratch.path().join("corpus.jsonl").is_file() {
                return Err(Error::NotFound(format!(
                    "source_uri {uri:?} has no corpus.jsonl ({copied} objects found)"
                )));
            }
            Ok(BeirSource::Downloaded(scratch))
        }
    }
}

/// Opens the index at `uri`; an S3 index is first copied to `<cache_root>/<name>`.
pub async fn load(name: &str, uri: &str, cache_root: &Path, s3: &S3Args) -> Result<Collection, Error> {
    let store = ObjectStore::open(uri, s3)?;
    let dir = match &store {
        ObjectStore::Local { root } => root.clone(),
        ObjectStore::S3 { .. } => {
            let dir = cache_root.join(format!(".loaded-{name}"));
            if dir.exists() {
                tokio::fs::remove_dir_all(&dir).await.map_err(|e| Error::io(&dir, e))?;
            }
            let copied = download(&store, &dir).await?;
            if copied == 0 {
                return Err(Error::NotFound(format!("no index at {uri:?} (no objects under it)")));
            }
            dir
        }
    };
    let uri = uri.to_owned();
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || {
        let collection = Collection::open(&dir, uri)?;
        if collection.name() != name {
            tracing::info!(indexed_as = collection.name(), served_as = %name, "serving collection under a new name");
        }
        Ok::<_, Error>(collection.renamed(name))
    })
    .await
    .map_err(|join| Error::Internal(join.to_string()))?
}

/// Copies every file of the index directory `dir` to `destination`; returns bytes written.
pub async fn publish(dir: &Path, destination: &ObjectStore) -> Result<u64, Error> {
    let source = ObjectStore::Local { root: dir.to_owned() };
    let mut bytes = 0;
    let keys = source.list("").await?;
    // The manifest goes last: its presence marks a complete index at the destination.
    let (manifest, rest): (Vec<_>, Vec<_>) = keys.into_iter().partition(|key| key == "manifest.json");
    for key in rest.into_iter().chain(manifest) {
        let data = source.get(&key).await?;
        bytes += data.len() as u64;
        destination.put(&key, data).await?;
    }
    Ok(bytes)
}

async fn download(store: &ObjectStore, dir: &Path) -> Result<usize, Error> {
    let keys = store.list("").await?;
    let local = ObjectStore::Local { root: dir.to_owned() };
    for key in &keys {
        local.put(key, store.get(key).await?).await?;
    }
    Ok(keys.len())
}
