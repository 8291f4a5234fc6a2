-- The run-state tables as they were before versioned migrations. IF NOT
-- EXISTS, so a database made by an older Sleuth (which created these tables
-- at start) is adopted as version 1 with its rows. The same DDL serves
-- SQLite and PostgreSQL.

-- Orchestrator: runs with their specs and status.
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    status INTEGER NOT NULL,
    detail TEXT NOT NULL,
    created_unix BIGINT NOT NULL,
    updated_unix BIGINT NOT NULL
);

-- Orchestrator: each trajectory group published to a run's stream, once.
CREATE TABLE IF NOT EXISTS run_groups (
    run_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    stream_id TEXT NOT NULL,
    reward_mean DOUBLE PRECISION NOT NULL,
    policy_version BIGINT NOT NULL,
    PRIMARY KEY (run_id, group_id)
);

-- Orchestrator: one summary per episode of a run.
CREATE TABLE IF NOT EXISTS run_episodes (
    run_id TEXT NOT NULL,
    episode_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    outcome INTEGER NOT NULL,
    reward DOUBLE PRECISION NOT NULL,
    ndcg DOUBLE PRECISION NOT NULL,
    turns BIGINT NOT NULL,
    tokens BIGINT NOT NULL,
    policy_version BIGINT NOT NULL,
    PRIMARY KEY (run_id, episode_id)
);

-- Orchestrator: the validation of each version a run published.
CREATE TABLE IF NOT EXISTS run_validations (
    run_id TEXT NOT NULL,
    version BIGINT NOT NULL,
    evaluation_id TEXT NOT NULL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (run_id, version)
);

-- Learner: the metrics of each step (JSON).
CREATE TABLE IF NOT EXISTS learner_steps (
    run_id TEXT NOT NULL,
    step BIGINT NOT NULL,
    metrics TEXT NOT NULL,
    created_unix BIGINT NOT NULL,
    PRIMARY KEY (run_id, step)
);

-- Learner: what became of every stream entry it took.
CREATE TABLE IF NOT EXISTS learner_groups (
    run_id TEXT NOT NULL,
    entry_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    step BIGINT NOT NULL,
    disposition TEXT NOT NULL,
    detail TEXT NOT NULL,
    token_version BIGINT NOT NULL,
    PRIMARY KEY (run_id, entry_id)
);
