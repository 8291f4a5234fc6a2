//! Task sets: the judged queries of one split of a BEIR collection.

use sleuth_beir::{BadLines, BeirDir};
use sleuth_proto::common::v1::Task;
use sleuth_proto::rollout::v1::TaskSet;
use sleuth_store::LocalRoots;

/// Where task sets may be read (`--task-roots`, named in refusals).
pub const ROOTS_SETTING: &str = "SLEUTH_TASK_ROOTS";

/// [`load`] on a blocking thread: a collection's files are read with
/// blocking I/O, which must not hold up the runtime's other requests.
pub async fn load_off_runtime(set: TaskSet, field: &'static str, roots: LocalRoots) -> Result<Vec<Task>, String> {
    tokio::task::spawn_blocking(move || load(&set, field, &roots))
        .await
        .map_err(|e| format!("{field}: reading the task set stopped: {e}"))?
}

/// The tasks of `set` (queries with judgements in its split, file order, at
/// most `limit`), or an error naming the field. The source must lie inside
/// `roots` once links and `..` are resolved: a caller names a directory of
/// the orchestrator's disk, which must not be any directory.
pub fn load(set: &TaskSet, field: &str, roots: &LocalRoots) -> Result<Vec<Task>, String> {
    if set.source_uri.starts_with("s3://") {
        return Err(format!(
            "{field}.source_uri {:?}: task sets from s3:// are not supported yet; use a local BEIR directory",
            set.source_uri
        ));
    }
    if set.collection.trim().is_empty() {
        return Err(format!("{field}.collection must name the tool-gateway collection the agent searches"));
    }
    // No default split: a missing one used to mean "test", so a training run
    // silently trained on the held-out queries it would be judged on.
    if set.split.trim().is_empty() {
        return Err(format!("{field}.split must name the BEIR split to use (train, dev, test, ...)"));
    }
    // The split names a file under qrels/: a plain name, never a path.
    sleuth_kit::names::check_name("split", &set.split).map_err(|e| format!("{field}: {e}"))?;
    let source = roots
        .confine(&set.source_uri, std::path::Path::new(&set.source_uri))
        .map_err(|e| format!("{field}.source_uri: {e}"))?;
    let dir = BeirDir::new(&source);
    let split = set.split.as_str();
    let qrels =
        dir.qrels(split).map_err(|e| format!("{field}.source_uri {:?} split {split:?}: {e}", set.source_uri))?;
    let queries = dir.queries(BadLines::Fail).map_err(|e| format!("{field}.source_uri {:?}: {e}", set.source_uri))?;
    let mut tasks: Vec<Task> = queries
        .into_iter()
        .filter_map(|q| {
            let judgements = qrels.get(&q.id)?;
            Some(Task {
                task_id: q.id,
                question: q.text,
                collection: set.collection.clone(),
                qrels: judgements.iter().map(|(d, r)| (d.clone(), *r)).collect(),
                answers: q.answers,
            })
        })
        .collect();
    if set.limit > 0 {
        tasks.truncate(set.limit as usize);
    }
    if tasks.is_empty() {
        return Err(format!("{field}: split {split:?} of {:?} has no judged queries", set.source_uri));
    }
    Ok(tasks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_is_a_plain_name_never_a_path() {
        for split in ["../../etc/passwd", "dev/../../x", ".hidden", "a b"] {
            let set =
                TaskSet { source_uri: "/data/scifact".into(), collection: "c".into(), split: split.into(), limit: 0 };
            let roots = LocalRoots { roots: vec!["/".into()], setting: ROOTS_SETTING };
            let error = load(&set, "tasks", &roots).unwrap_err();
            assert!(error.starts_with("tasks: invalid split"), "{split}: {error}");
            assert!(!error.contains("No such file"), "{split} reached the disk: {error}");
        }
    }

    /// A source outside the roots (or through a link or `..` out of them)
    /// is refused, naming the setting, before any of its files is opened.
    #[test]
    fn a_task_set_outside_the_roots_is_refused_by_name() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("link")).unwrap();
        let roots = LocalRoots { roots: vec![root.path().to_owned()], setting: ROOTS_SETTING };
        for source in
            [outside.path().to_owned(), root.path().join("link"), root.path().join("inside/../../etc"), "/etc".into()]
        {
            let set = TaskSet {
                source_uri: source.display().to_string(),
                collection: "c".into(),
                split: "test".into(),
                limit: 0,
            };
            let error = load(&set, "tasks", &roots).unwrap_err();
            assert!(error.starts_with("tasks.source_uri") && error.contains(ROOTS_SETTING), "{source:?}: {error}");
        }
        let none = LocalRoots { roots: Vec::new(), setting: ROOTS_SETTING };
        let set = TaskSet {
            source_uri: root.path().display().to_string(),
            collection: "c".into(),
            split: "test".into(),
            limit: 0,
        };
        let error = load(&set, "tasks", &none).unwrap_err();
        assert!(error.contains("names no directory"), "without roots no local task set is read: {error}");
    }
}
