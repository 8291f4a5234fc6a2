//! Per-step metrics in SQL (SQLite by default, PostgreSQL when configured),
//! one row per run and step, written after the step; rewriting a step (a
//! replay after a crash) replaces its row.

use sleuth_store::{Database, StoreError};

use crate::trainer::StepStats;

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS learner_steps (
    run_id TEXT NOT NULL,
    step BIGINT NOT NULL,
    metrics TEXT NOT NULL,
    created_unix BIGINT NOT NULL,
    PRIMARY KEY (run_id, step)
)";

fn failed(database: &Database, source: sqlx::Error) -> StoreError {
    StoreError::Sql { url: database.url().to_owned(), source }
}

pub async fn migrate(database: &Database) -> Result<(), StoreError> {
    sqlx::query(SCHEMA).execute(database.pool()).await.map_err(|e| failed(database, e))?;
    Ok(())
}

/// Records one step's metrics (JSON: every field of [`StepStats`] plus `extra`).
pub async fn record(
    database: &Database,
    run_id: &str,
    stats: &StepStats,
    extra: &serde_json::Value,
) -> Result<(), StoreError> {
    let mut metrics = serde_json::to_value(stats).unwrap_or_default();
    if let (Some(object), Some(more)) = (metrics.as_object_mut(), extra.as_object()) {
        object.extend(more.clone());
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    sqlx::query(
        "INSERT INTO learner_steps (run_id, step, metrics, created_unix) VALUES ($1, $2, $3, $4)
         ON CONFLICT (run_id, step) DO UPDATE SET metrics = excluded.metrics, created_unix = excluded.created_unix",
    )
    .bind(run_id)
    .bind(stats.step as i64)
    .bind(metrics.to_string())
    .bind(now as i64)
    .execute(database.pool())
    .await
    .map_err(|e| failed(database, e))?;
    Ok(())
}

/// The metrics of every recorded step of `run_id`, in step order.
pub async fn steps(database: &Database, run_id: &str) -> Result<Vec<(u64, serde_json::Value)>, StoreError> {
    use sqlx::Row;
    let rows = sqlx::query("SELECT step, metrics FROM learner_steps WHERE run_id = $1 ORDER BY step")
        .bind(run_id)
        .fetch_all(database.pool())
        .await
        .map_err(|e| failed(database, e))?;
    rows.iter()
        .map(|row| {
            let step: i64 = row.try_get("step").map_err(|e| failed(database, e))?;
            let text: String = row.try_get("metrics").map_err(|e| failed(database, e))?;
            Ok((step as u64, serde_json::from_str(&text).unwrap_or_default()))
        })
        .collect()
}
