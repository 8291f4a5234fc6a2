//! What the learner did, in SQL (SQLite by default, PostgreSQL when
//! configured): per-step metrics (`learner_steps`, one row per run and step)
//! and what became of every group it took off the stream (`learner_groups`,
//! one row per stream entry: trained in which step, or dropped and why).
//! Both are written after the step trains. Steps after the checkpoint a
//! resumed learner starts from are forgotten ([`forget_after`]) and written
//! again by the replay, so the records describe the weights the run has.
//! The tables are made by the store's migrations (`sleuth_store::sql::MIGRATOR`).

use sleuth_store::{Database, StoreError};

use crate::trainer::StepStats;

fn failed(database: &Database, source: sqlx::Error) -> StoreError {
    StoreError::Sql { url: database.url().to_owned(), source }
}

/// What became of one group the learner took off the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Its episodes were in the step's batch.
    Trained,
    /// Its tokens were sampled more than `max_staleness` versions ago.
    Stale,
    /// Its rewards were all equal: no advantage to learn from.
    Flat,
    /// It could not be decoded or turned into samples (`detail` says why).
    Rejected,
    /// Trajectory SFT: none of its episodes reached `sft_min_reward`.
    BelowMinReward,
}

impl Disposition {
    const ALL: [Disposition; 5] = [
        Disposition::Trained,
        Disposition::Stale,
        Disposition::Flat,
        Disposition::Rejected,
        Disposition::BelowMinReward,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Disposition::Trained => "trained",
            Disposition::Stale => "stale",
            Disposition::Flat => "flat",
            Disposition::Rejected => "rejected",
            Disposition::BelowMinReward => "below_min_reward",
        }
    }
}

impl std::str::FromStr for Disposition {
    type Err = String;

    /// The disposition [`Disposition::as_str`] wrote; anything else is an error.
    fn from_str(text: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|d| d.as_str() == text).ok_or_else(|| format!("unknown disposition {text:?}"))
    }
}

/// One row of `learner_groups`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord {
    /// The stream entry the group came in (`<ms>-<seq>`).
    pub entry_id: String,
    /// The orchestrator's group id (empty when the entry could not be decoded).
    pub group_id: String,
    /// The step that trained it, or that was being formed when it was dropped.
    pub step: u64,
    pub disposition: Disposition,
    /// Why a group was dropped; empty for trained ones.
    pub detail: String,
    /// The oldest policy version that sampled any of its tokens.
    pub token_version: u64,
}

/// Records what became of the groups one step took (see [`GroupRecord`]).
pub async fn record_groups(database: &Database, run_id: &str, groups: &[GroupRecord]) -> Result<(), StoreError> {
    let mut transaction = database.pool().begin().await.map_err(|e| failed(database, e))?;
    for group in groups {
        sqlx::query(
            "INSERT INTO learner_groups (run_id, entry_id, group_id, step, disposition, detail, token_version)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (run_id, entry_id) DO UPDATE SET group_id = excluded.group_id, step = excluded.step,
                 disposition = excluded.disposition, detail = excluded.detail, token_version = excluded.token_version",
        )
        .bind(run_id)
        .bind(&group.entry_id)
        .bind(&group.group_id)
        .bind(group.step as i64)
        .bind(group.disposition.as_str())
        .bind(&group.detail)
        .bind(group.token_version as i64)
        .execute(&mut *transaction)
        .await
        .map_err(|e| failed(database, e))?;
    }
    transaction.commit().await.map_err(|e| failed(database, e))?;
    Ok(())
}

/// The groups of `run_id` the learner took, in stream order.
pub async fn groups(database: &Database, run_id: &str) -> Result<Vec<GroupRecord>, StoreError> {
    use sqlx::Row;
    let rows = sqlx::query(
        "SELECT entry_id, group_id, step, disposition, detail, token_version FROM learner_groups WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_all(database.pool())
    .await
    .map_err(|e| failed(database, e))?;
    let mut groups = rows
        .iter()
        .map(|row| {
            let text = |name: &str| row.try_get::<String, _>(name).map_err(|e| failed(database, e));
            let number = |name: &str| row.try_get::<i64, _>(name).map_err(|e| failed(database, e));
            let disposition: Disposition =
                text("disposition")?.parse().map_err(|e: String| failed(database, sqlx::Error::Decode(e.into())))?;
            Ok(GroupRecord {
                entry_id: text("entry_id")?,
                group_id: text("group_id")?,
                step: number("step")? as u64,
                disposition,
                detail: text("detail")?,
                token_version: number("token_version")? as u64,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    groups.sort_by_key(|g| g.entry_id.parse::<sleuth_store::trajectories::EntryId>().unwrap_or_default());
    Ok(groups)
}

/// Forgets the steps of `run_id` after `step` (and the groups they took): a
/// learner resuming from the checkpoint at `step` trains them again.
pub async fn forget_after(database: &Database, run_id: &str, step: u64) -> Result<(), StoreError> {
    for statement in [
        "DELETE FROM learner_steps WHERE run_id = $1 AND step > $2",
        "DELETE FROM learner_groups WHERE run_id = $1 AND step > $2",
    ] {
        sqlx::query(statement)
            .bind(run_id)
            .bind(step as i64)
            .execute(database.pool())
            .await
            .map_err(|e| failed(database, e))?;
    }
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
    database.learner_steps(run_id).await
}
