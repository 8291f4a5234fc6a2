//! What the dashboard reads besides the run state: the staleness of the
//! groups the learner trained (`learner_groups`, present when the learner
//! records to the same database, as in the chart and the demo; its step
//! metrics come from `Database::learner_steps`), the learner's disposition
//! of one group, and the evaluation reports the orchestrator wrote.

use std::collections::BTreeMap;
use std::path::Path;

use sleuth_store::{Database, StoreError};
use sqlx::Row;

fn failed(database: &Database, source: sqlx::Error) -> StoreError {
    StoreError::Sql { url: database.url().to_owned(), source }
}

/// Per step, the mean and largest staleness of the groups it trained: how
/// many versions the learner had moved on between the oldest weights that
/// sampled a group's tokens and the version it trained that group at.
pub async fn staleness(database: &Database, run_id: &str) -> Result<Vec<(u64, f64, f64)>, StoreError> {
    let rows = sqlx::query(
        "SELECT step, CAST(AVG(CAST(step - 1 - token_version AS DOUBLE PRECISION)) AS DOUBLE PRECISION) AS mean,
                CAST(MAX(step - 1 - token_version) AS DOUBLE PRECISION) AS most
         FROM learner_groups WHERE run_id = $1 AND disposition = 'trained' GROUP BY step ORDER BY step",
    )
    .bind(run_id)
    .fetch_all(database.pool())
    .await
    .map_err(|e| failed(database, e))?;
    rows.iter()
        .map(|row| Ok((row.try_get::<i64, _>("step")? as u64, row.try_get("mean")?, row.try_get("most")?)))
        .collect::<Result<_, sqlx::Error>>()
        .map_err(|e| failed(database, e))
}

/// The group an episode of a run belongs to; None when there is no such episode.
pub async fn group_of(database: &Database, run_id: &str, episode_id: &str) -> Result<Option<String>, StoreError> {
    sqlx::query_scalar("SELECT group_id FROM run_episodes WHERE run_id = $1 AND episode_id = $2")
        .bind(run_id)
        .bind(episode_id)
        .fetch_optional(database.pool())
        .await
        .map_err(|e| failed(database, e))
}

/// What the learner did with a group: the step, its disposition (`trained`,
/// `stale`, ...) and why it dropped it.
#[derive(Debug, Clone, PartialEq)]
pub struct Taken {
    pub step: u64,
    pub disposition: String,
    pub detail: String,
}

/// What the learner did with `group_id`; None while it has not taken it
/// (or when it records to another database).
pub async fn taken(database: &Database, run_id: &str, group_id: &str) -> Result<Option<Taken>, StoreError> {
    let row = sqlx::query(
        "SELECT step, disposition, detail FROM learner_groups WHERE run_id = $1 AND group_id = $2
         ORDER BY step DESC LIMIT 1",
    )
    .bind(run_id)
    .bind(group_id)
    .fetch_optional(database.pool())
    .await
    .map_err(|e| failed(database, e))?;
    row.map(|row| {
        Ok(Taken {
            step: row.try_get::<i64, _>("step")? as u64,
            disposition: row.try_get("disposition")?,
            detail: row.try_get("detail")?,
        })
    })
    .transpose()
    .map_err(|e: sqlx::Error| failed(database, e))
}

/// The validations recorded for each evaluation id: (run, version).
pub async fn validation_owners(database: &Database) -> Result<BTreeMap<String, (String, u64)>, StoreError> {
    let rows = sqlx::query("SELECT run_id, version, evaluation_id FROM run_validations")
        .fetch_all(database.pool())
        .await
        .map_err(|e| failed(database, e))?;
    rows.iter()
        .map(|row| {
            Ok((
                row.try_get::<String, _>("evaluation_id")?,
                (row.try_get::<String, _>("run_id")?, row.try_get::<i64, _>("version")? as u64),
            ))
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(|e| failed(database, e))
}

/// One evaluation report (`<report_dir>/<id>.json`, written by the job).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct Report {
    pub evaluation_id: String,
    /// `policy` or `baseline:<method>`; empty in reports of older releases.
    #[serde(default)]
    pub contender: String,
    #[serde(default)]
    pub collection: String,
    #[serde(default)]
    pub split: String,
    #[serde(default)]
    pub tasks: u64,
    #[serde(default)]
    pub metrics: BTreeMap<String, f64>,
    /// Each task's nDCG@10; empty in reports of older releases (no interval then).
    #[serde(default, rename = "per_task_ndcg@10")]
    pub per_task: BTreeMap<String, f64>,
}

/// The evaluation reports under `dir` (`*.json`), newest first, with when
/// each was written (a report is rewritten only when its job reruns).
pub fn report_files(dir: &Path) -> Vec<(std::path::PathBuf, std::time::SystemTime)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<_> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|path| path.extension().is_some_and(|e| e == "json"))
        .map(|path| {
            let written = std::fs::metadata(&path).and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
            (path, written)
        })
        .collect();
    files.sort_by(|(a, x), (b, y)| y.cmp(x).then_with(|| b.cmp(a)));
    files
}

/// One report file; the error says why it is not one.
pub fn read_report(path: &Path) -> Result<Report, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    serde_json::from_slice(&bytes).map_err(|e| e.to_string())
}
