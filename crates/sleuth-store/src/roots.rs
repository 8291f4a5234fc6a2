//! Where a request may point a service on its own disk. A policy server
//! loads checkpoints and a tool gateway reads and writes collections at
//! local paths that callers name; each path must lie inside the directories
//! the operator configured, once links and `..` are resolved, so a caller
//! cannot make a service read or write any other directory of its disk.
//! Paths from the operator's own configuration are not confined.

use std::path::{Component, Path, PathBuf};

use crate::StoreError;
use crate::object::{ObjectStore, S3Args};

/// The directories local paths from requests must lie in.
#[derive(Clone, Debug)]
pub struct LocalRoots {
    /// The allowed directories (they need not exist yet).
    pub roots: Vec<PathBuf>,
    /// The setting that lists them (e.g. `SLEUTH_CHECKPOINT_ROOTS`), named in refusals.
    pub setting: &'static str,
}

impl LocalRoots {
    /// Opens `uri` like [`ObjectStore::open`], refusing a local path outside the roots.
    pub fn open(&self, uri: &str, s3: &S3Args) -> Result<ObjectStore, StoreError> {
        match ObjectStore::open(uri, s3)? {
            ObjectStore::Local { root } => Ok(ObjectStore::Local { root: self.confine(uri, &root)? }),
            remote => Ok(remote),
        }
    }

    /// `path` resolved (links and `..`), if it lies inside a root. A path that
    /// does not exist yet (a destination) is resolved through its nearest
    /// existing ancestor, and the rest may only name plain folders.
    pub fn confine(&self, uri: &str, path: &Path) -> Result<PathBuf, StoreError> {
        let refused = |message: String| StoreError::Outside { uri: uri.to_owned(), setting: self.setting, message };
        if self.roots.is_empty() {
            return Err(refused(format!("is a local path and {} names no directory", self.setting)));
        }
        let resolved = resolve(path).map_err(|e| refused(e.to_string()))?;
        let inside = self.roots.iter().filter_map(|root| resolve(root).ok()).any(|root| resolved.starts_with(root));
        if inside { Ok(resolved) } else { Err(refused(format!("resolves to {}, outside them", resolved.display()))) }
    }
}

/// `path` with links and `..` resolved; the part below its nearest existing
/// ancestor is appended as is, and may only hold plain names.
fn resolve(path: &Path) -> std::io::Result<PathBuf> {
    let absolute = std::path::absolute(path)?;
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    while !existing.exists() {
        let (Some(parent), Some(name)) = (existing.parent(), existing.file_name()) else { break };
        rest.push(name.to_owned());
        existing = parent;
    }
    if absolute.strip_prefix(existing).is_ok_and(|below| below.components().any(|c| !matches!(c, Component::Normal(_))))
    {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "`..` below a folder that does not exist"));
    }
    let mut resolved = existing.canonicalize()?;
    resolved.extend(rest.iter().rev());
    Ok(resolved)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_before_they_are_judged() {
        let scratch = tempfile::tempdir().unwrap();
        let root = scratch.path().join("allowed");
        std::fs::create_dir_all(root.join("inside")).unwrap();
        std::fs::create_dir_all(scratch.path().join("secret")).unwrap();
        std::os::unix::fs::symlink(scratch.path().join("secret"), root.join("link")).unwrap();
        let roots = LocalRoots { roots: vec![root.clone()], setting: "SLEUTH_TEST_ROOTS" };
        let judge = |path: PathBuf| roots.confine(&path.display().to_string(), &path);

        assert!(judge(root.join("inside")).is_ok());
        assert!(judge(root.join("not-yet/deeper")).is_ok(), "a destination to be made");
        for outside in [
            scratch.path().join("secret"),
            root.join("../secret"),
            root.join("link"),
            root.join("link/new-folder"),
            root.join("not-yet/../../secret"),
        ] {
            let error = judge(outside.clone()).unwrap_err();
            assert!(error.to_string().contains("SLEUTH_TEST_ROOTS"), "{}: {error}", outside.display());
        }
        let none = LocalRoots { roots: Vec::new(), setting: "SLEUTH_TEST_ROOTS" };
        assert!(none.confine("x", &root).is_err(), "no roots: every local path is refused");
    }
}
