//! Task sets: the judged queries of one split of a BEIR collection.

use sleuth_beir::{BadLines, BeirDir};
use sleuth_proto::common::v1::Task;
use sleuth_proto::rollout::v1::TaskSet;

/// The tasks of `set` (queries with judgements in its split, file order, at
/// most `limit`), or an error naming the field.
pub fn load(set: &TaskSet, field: &str) -> Result<Vec<Task>, String> {
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
    let dir = BeirDir::new(&set.source_uri);
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
            let error = load(&set, "tasks").unwrap_err();
            assert!(error.starts_with("tasks: invalid split"), "{split}: {error}");
            assert!(!error.contains("No such file"), "{split} reached the disk: {error}");
        }
    }
}
