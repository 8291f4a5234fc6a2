//! Run state in SQL (SQLite by default, PostgreSQL when configured; the same
//! DDL serves both): runs with their specs, status and progress, published groups,
//! per-episode summaries and validations. The tables are made by the
//! store's migrations (`sleuth_store::sql::MIGRATOR`).

use prost::Message;
use sleuth_proto::common::v1::{EpisodeOutcome, TrajectoryGroup};
use sleuth_proto::rollout::v1::{EpisodeSummary, Run, RunProgress, RunSpec, RunStatus, Validation, VersionStats};
use sleuth_store::{Database, StoreError};
use sqlx::Row;

fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len() / 2).filter_map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()).collect()
}

/// The progress counters a run's record keeps.
#[derive(Clone, Copy)]
enum Counter {
    /// Groups published (`runs.groups_published`).
    Groups,
    /// Episodes recorded (`runs.episodes_finished`).
    Episodes,
}

#[derive(Clone)]
pub struct State {
    db: Database,
}

/// The columns of a run's row, named: never `SELECT *`. A SQLite
/// connection that prepared `SELECT *` before another connection's migration
/// added columns is re-prepared by SQLite with more columns than the driver
/// cached, and the driver panics reading the row (seen when the learner and
/// the orchestrator start together and one of them migrates). A named list
/// has the same columns however often it is prepared.
/// (A macro so queries stay `&'static str` for sqlx.)
macro_rules! run_columns {
    () => {
        "run_id, spec, status, detail, created_unix, updated_unix, groups_total, groups_published, episodes_finished"
    };
}

impl State {
    /// The state in `db`, its schema migrated to this build's version.
    pub async fn open(db: Database) -> Result<Self, StoreError> {
        db.migrate().await?;
        Ok(Self { db })
    }

    fn failed(db: &Database, source: sqlx::Error) -> StoreError {
        StoreError::Sql { url: db.url().to_owned(), source }
    }

    fn error(&self, source: sqlx::Error) -> StoreError {
        Self::failed(&self.db, source)
    }

    /// Inserts a new run; false when the id exists (idempotent create).
    pub async fn create(&self, run_id: &str, spec: &RunSpec) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "INSERT INTO runs (run_id, spec, status, detail, created_unix, updated_unix) VALUES ($1, $2, $3, '', $4, $4)
             ON CONFLICT (run_id) DO NOTHING",
        )
        .bind(run_id)
        .bind(hex(&spec.encode_to_vec()))
        .bind(RunStatus::Running as i32)
        .bind(now())
        .execute(self.db.pool())
        .await
        .map_err(|e| self.error(e))?;
        Ok(result.rows_affected() == 1)
    }

    /// Moves `run_id` from `from` to `to` with `detail` as the reason, in one
    /// conditional update; false when the run is not in `from` (it ended, or
    /// another caller moved it first). Every status change goes through
    /// here, so two callers racing (a run ending as it is cancelled, two
    /// resumes of one failed run) cannot both win.
    pub async fn transition(
        &self,
        run_id: &str,
        from: RunStatus,
        to: RunStatus,
        detail: &str,
    ) -> Result<bool, StoreError> {
        let result = sqlx::query(
            "UPDATE runs SET status = $1, detail = $2, updated_unix = $3 WHERE run_id = $4 AND status = $5",
        )
        .bind(to as i32)
        .bind(detail)
        .bind(now())
        .bind(run_id)
        .bind(from as i32)
        .execute(self.db.pool())
        .await
        .map_err(|e| self.error(e))?;
        Ok(result.rows_affected() == 1)
    }

    /// Records how many groups `run_id` publishes in all (tasks x epochs),
    /// counted when the run is driven.
    pub async fn set_groups_total(&self, run_id: &str, total: u64) -> Result<(), StoreError> {
        sqlx::query("UPDATE runs SET groups_total = $1 WHERE run_id = $2")
            .bind(total as i64)
            .bind(run_id)
            .execute(self.db.pool())
            .await
            .map_err(|e| self.error(e))?;
        Ok(())
    }

    /// A run from its row (the columns of `run_columns!`).
    fn run_from(row: &sqlx::any::AnyRow) -> Result<Run, sqlx::Error> {
        let spec: String = row.try_get("spec")?;
        let created: i64 = row.try_get("created_unix")?;
        let updated: i64 = row.try_get("updated_unix")?;
        let run_id: String = row.try_get("run_id")?;
        let count = |column: &str| row.try_get::<i64, _>(column).map(|n| n.max(0) as u64);
        // What this process is doing now (epoch, episodes in flight, the
        // learner's version) is added by the runner driving the run.
        let progress = RunProgress {
            groups_total: count("groups_total")?,
            groups_published: count("groups_published")?,
            episodes_finished: count("episodes_finished")?,
            ..Default::default()
        };
        Ok(Run {
            stream_key: sleuth_store::trajectories::stream_key(&run_id),
            run_id,
            spec: RunSpec::decode(unhex(&spec).as_slice()).ok(),
            status: row.try_get::<i32, _>("status")?,
            status_detail: row.try_get("detail")?,
            created_at: Some(prost_types::Timestamp { seconds: created, nanos: 0 }),
            updated_at: Some(prost_types::Timestamp { seconds: updated, nanos: 0 }),
            progress: Some(progress),
            validations: Vec::new(),
            best_version: 0,
            training: Vec::new(),
        })
    }

    pub async fn run(&self, run_id: &str) -> Result<Option<Run>, StoreError> {
        let row = sqlx::query(concat!("SELECT ", run_columns!(), " FROM runs WHERE run_id = $1"))
            .bind(run_id)
            .fetch_optional(self.db.pool())
            .await
            .map_err(|e| self.error(e))?;
        row.map(|r| Self::run_from(&r).map_err(|e| self.error(e))).transpose()
    }

    /// Runs, newest first, after `offset`.
    pub async fn runs(&self, offset: i64, limit: i64) -> Result<Vec<Run>, StoreError> {
        let rows = sqlx::query(concat!(
            "SELECT ",
            run_columns!(),
            " FROM runs ORDER BY created_unix DESC, run_id DESC LIMIT $1 OFFSET $2"
        ))
        .bind(limit)
        .bind(offset)
        .fetch_all(self.db.pool())
        .await
        .map_err(|e| self.error(e))?;
        rows.iter().map(|r| Self::run_from(r).map_err(|e| self.error(e))).collect()
    }

    /// Runs still running (to resume after a restart).
    pub async fn unfinished(&self) -> Result<Vec<Run>, StoreError> {
        let rows = sqlx::query(concat!("SELECT ", run_columns!(), " FROM runs WHERE status = $1"))
            .bind(RunStatus::Running as i32)
            .fetch_all(self.db.pool())
            .await
            .map_err(|e| self.error(e))?;
        rows.iter().map(|r| Self::run_from(r).map_err(|e| self.error(e))).collect()
    }

    /// Records a published group, with its trajectories (the encoded
    /// `TrajectoryGroup`) when known (a group found published after a crash
    /// is recorded without them), and counts it in the run's record, in one
    /// transaction; a repeat changes nothing.
    pub async fn record_group(
        &self,
        run_id: &str,
        group_id: &str,
        stream_id: &str,
        reward_mean: f64,
        version: u64,
        trajectories: Option<&[u8]>,
    ) -> Result<(), StoreError> {
        let mut transaction = self.db.pool().begin().await.map_err(|e| self.error(e))?;
        let inserted = sqlx::query(
            "INSERT INTO run_groups (run_id, group_id, stream_id, reward_mean, policy_version, trajectory)
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (run_id, group_id) DO NOTHING",
        )
        .bind(run_id)
        .bind(group_id)
        .bind(stream_id)
        .bind(reward_mean)
        .bind(version as i64)
        .bind(trajectories)
        .execute(&mut *transaction)
        .await
        .map_err(|e| self.error(e))?;
        if inserted.rows_affected() == 1 {
            Self::count_in_record(&mut transaction, run_id, Counter::Groups).await.map_err(|e| self.error(e))?;
        }
        transaction.commit().await.map_err(|e| self.error(e))
    }

    /// Adds one to a progress counter of `run_id`'s record, inside the
    /// transaction that records what it counts.
    async fn count_in_record(
        transaction: &mut sqlx::Transaction<'_, sqlx::Any>,
        run_id: &str,
        counter: Counter,
    ) -> Result<(), sqlx::Error> {
        let update = match counter {
            Counter::Groups => {
                "UPDATE runs SET groups_published = groups_published + 1, updated_unix = $1 WHERE run_id = $2"
            }
            Counter::Episodes => {
                "UPDATE runs SET episodes_finished = episodes_finished + 1, updated_unix = $1 WHERE run_id = $2"
            }
        };
        sqlx::query(update).bind(now()).bind(run_id).execute(&mut **transaction).await?;
        Ok(())
    }

    /// The trajectories of a published group; None when the group is not
    /// (yet) published or was recorded before trajectories were kept.
    pub async fn group_trajectories(
        &self,
        run_id: &str,
        group_id: &str,
    ) -> Result<Option<TrajectoryGroup>, StoreError> {
        let encoded: Option<Option<Vec<u8>>> =
            sqlx::query_scalar("SELECT trajectory FROM run_groups WHERE run_id = $1 AND group_id = $2")
                .bind(run_id)
                .bind(group_id)
                .fetch_optional(self.db.pool())
                .await
                .map_err(|e| self.error(e))?;
        encoded
            .flatten()
            .map(|bytes| {
                TrajectoryGroup::decode(bytes.as_slice()).map_err(|e| StoreError::Object {
                    store: self.db.url().to_owned(),
                    message: format!("group {group_id:?} of run {run_id:?} is not a TrajectoryGroup: {e}"),
                })
            })
            .transpose()
    }

    pub async fn published_groups(&self, run_id: &str) -> Result<Vec<String>, StoreError> {
        let rows = sqlx::query("SELECT group_id FROM run_groups WHERE run_id = $1")
            .bind(run_id)
            .fetch_all(self.db.pool())
            .await
            .map_err(|e| self.error(e))?;
        rows.iter().map(|r| r.try_get::<String, _>("group_id").map_err(|e| self.error(e))).collect()
    }

    /// Records an episode's summary, adds it to its version's sums
    /// ([`State::outcomes`]) and counts it in the run's record, in one
    /// transaction; a repeat changes nothing.
    pub async fn record_episode(
        &self,
        run_id: &str,
        group_id: &str,
        summary: &EpisodeSummary,
    ) -> Result<(), StoreError> {
        let ndcg = summary.metrics.get("ndcg@10").copied().unwrap_or(0.0);
        let mut transaction = self.db.pool().begin().await.map_err(|e| self.error(e))?;
        let inserted = sqlx::query(
            "INSERT INTO run_episodes (run_id, episode_id, group_id, task_id, outcome, reward, ndcg, turns, tokens, policy_version, trace_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT (run_id, episode_id) DO NOTHING",
        )
        .bind(run_id)
        .bind(&summary.episode_id)
        .bind(group_id)
        .bind(&summary.task_id)
        .bind(summary.outcome)
        .bind(summary.reward)
        .bind(ndcg)
        .bind(i64::from(summary.turns))
        .bind(i64::from(summary.total_tokens))
        .bind(summary.policy_version as i64)
        .bind(&summary.trace_id)
        .execute(&mut *transaction)
        .await
        .map_err(|e| self.error(e))?;
        if inserted.rows_affected() == 1 {
            sqlx::query(
                "INSERT INTO run_version_outcomes (run_id, policy_version, outcome, episodes, reward_sum, ndcg_sum, turns_sum, tokens_sum)
                 VALUES ($1, $2, $3, 1, $4, $5, $6, $7)
                 ON CONFLICT (run_id, policy_version, outcome) DO UPDATE SET
                     episodes = run_version_outcomes.episodes + 1,
                     reward_sum = run_version_outcomes.reward_sum + excluded.reward_sum,
                     ndcg_sum = run_version_outcomes.ndcg_sum + excluded.ndcg_sum,
                     turns_sum = run_version_outcomes.turns_sum + excluded.turns_sum,
                     tokens_sum = run_version_outcomes.tokens_sum + excluded.tokens_sum",
            )
            .bind(run_id)
            .bind(summary.policy_version as i64)
            .bind(summary.outcome)
            .bind(summary.reward)
            .bind(ndcg)
            .bind(f64::from(summary.turns))
            .bind(f64::from(summary.total_tokens))
            .execute(&mut *transaction)
            .await
            .map_err(|e| self.error(e))?;
            Self::count_in_record(&mut transaction, run_id, Counter::Episodes).await.map_err(|e| self.error(e))?;
        }
        transaction.commit().await.map_err(|e| self.error(e))
    }

    /// A page of `run_id`'s episode summaries, in episode id order (ids
    /// start with the group's, so a group's episodes are together).
    pub async fn episodes(&self, run_id: &str, offset: u64, limit: u64) -> Result<Vec<EpisodeSummary>, StoreError> {
        let rows = sqlx::query(
            "SELECT episode_id, task_id, outcome, reward, ndcg, turns, tokens, policy_version, trace_id
             FROM run_episodes WHERE run_id = $1 ORDER BY episode_id LIMIT $2 OFFSET $3",
        )
        .bind(run_id)
        .bind(limit as i64)
        .bind(offset as i64)
        .fetch_all(self.db.pool())
        .await
        .map_err(|e| self.error(e))?;
        rows.iter()
            .map(|row| {
                Ok(EpisodeSummary {
                    episode_id: row.try_get("episode_id")?,
                    task_id: row.try_get("task_id")?,
                    outcome: row.try_get("outcome")?,
                    reward: row.try_get("reward")?,
                    metrics: [("ndcg@10".to_owned(), row.try_get("ndcg")?)].into(),
                    turns: row.try_get::<i64, _>("turns")? as u32,
                    total_tokens: row.try_get::<i64, _>("tokens")? as u32,
                    policy_version: row.try_get::<i64, _>("policy_version")? as u64,
                    trace_id: row.try_get("trace_id")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| self.error(e))
    }

    /// Records the validation of `run_id` at `version` (a repeat replaces it).
    pub async fn record_validation(&self, run_id: &str, validation: &Validation) -> Result<(), StoreError> {
        let metrics = serde_json::to_string(&validation.metrics).unwrap_or_default();
        sqlx::query(
            "INSERT INTO run_validations (run_id, version, evaluation_id, metrics) VALUES ($1, $2, $3, $4)
             ON CONFLICT (run_id, version) DO UPDATE SET evaluation_id = excluded.evaluation_id, metrics = excluded.metrics",
        )
        .bind(run_id)
        .bind(validation.version as i64)
        .bind(&validation.evaluation_id)
        .bind(metrics)
        .execute(self.db.pool())
        .await
        .map_err(|e| self.error(e))?;
        Ok(())
    }

    /// The validations of `run_id`, oldest version first.
    pub async fn validations(&self, run_id: &str) -> Result<Vec<Validation>, StoreError> {
        let rows = sqlx::query(
            "SELECT version, evaluation_id, metrics FROM run_validations WHERE run_id = $1 ORDER BY version",
        )
        .bind(run_id)
        .fetch_all(self.db.pool())
        .await
        .map_err(|e| self.error(e))?;
        rows.iter()
            .map(|row| {
                let metrics: String = row.try_get("metrics").map_err(|e| self.error(e))?;
                Ok(Validation {
                    version: row.try_get::<i64, _>("version").map_err(|e| self.error(e))? as u64,
                    evaluation_id: row.try_get("evaluation_id").map_err(|e| self.error(e))?,
                    metrics: serde_json::from_str(&metrics).unwrap_or_default(),
                })
            })
            .collect()
    }

    /// The run's training episodes counted per (version, outcome), oldest
    /// version first: every per-version curve is drawn from these sums.
    pub async fn outcomes(&self, run_id: &str) -> Result<Vec<OutcomeCount>, StoreError> {
        let rows = sqlx::query(
            "SELECT policy_version, outcome, episodes, reward_sum, ndcg_sum, turns_sum, tokens_sum
             FROM run_version_outcomes WHERE run_id = $1 ORDER BY policy_version, outcome",
        )
        .bind(run_id)
        .fetch_all(self.db.pool())
        .await
        .map_err(|e| self.error(e))?;
        rows.iter()
            .map(|row| {
                Ok(OutcomeCount {
                    version: row.try_get::<i64, _>("policy_version")? as u64,
                    outcome: row.try_get("outcome")?,
                    episodes: row.try_get::<i64, _>("episodes")? as u64,
                    reward_sum: row.try_get("reward_sum")?,
                    ndcg_sum: row.try_get("ndcg_sum")?,
                    turns_sum: row.try_get("turns_sum")?,
                    tokens_sum: row.try_get("tokens_sum")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| self.error(e))
    }

    /// The run's training episodes per policy version, oldest version first.
    pub async fn training_stats(&self, run_id: &str) -> Result<Vec<VersionStats>, StoreError> {
        let mut stats: Vec<VersionStats> = Vec::new();
        let mut failed = Vec::new();
        for count in self.outcomes(run_id).await? {
            if stats.last().is_none_or(|s| s.version != count.version) {
                stats.push(VersionStats { version: count.version, ..Default::default() });
                failed.push(0);
            }
            let (last, failures) = (stats.last_mut().expect("pushed"), failed.last_mut().expect("pushed"));
            last.episodes += count.episodes;
            // Sums for now, means below.
            last.reward_mean += count.reward_sum;
            last.ndcg_mean += count.ndcg_sum;
            last.turns_mean += count.turns_sum;
            if count.outcome != EpisodeOutcome::Completed as i32 {
                *failures += count.episodes;
            }
        }
        for (stats, failures) in stats.iter_mut().zip(failed) {
            let n = stats.episodes.max(1) as f64;
            stats.reward_mean /= n;
            stats.ndcg_mean /= n;
            stats.turns_mean /= n;
            stats.failure_rate = failures as f64 / n;
        }
        Ok(stats)
    }
}

/// The training episodes one policy version sampled that ended one way.
#[derive(Debug, Clone, PartialEq)]
pub struct OutcomeCount {
    pub version: u64,
    /// `EpisodeOutcome` as stored.
    pub outcome: i32,
    pub episodes: u64,
    pub reward_sum: f64,
    pub ndcg_sum: f64,
    pub turns_sum: f64,
    pub tokens_sum: f64,
}
