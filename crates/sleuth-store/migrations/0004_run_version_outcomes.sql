-- Per run, policy version and outcome, the sums every per-version curve is
-- drawn from (GetRun's training statistics, the dashboard's run page). They
-- are kept up to date as episodes are recorded, so reading them costs the
-- number of versions, not of episodes (a run has ~100 episodes a step).
CREATE TABLE run_version_outcomes (
    run_id TEXT NOT NULL,
    policy_version BIGINT NOT NULL,
    outcome INTEGER NOT NULL,
    episodes BIGINT NOT NULL,
    reward_sum DOUBLE PRECISION NOT NULL,
    ndcg_sum DOUBLE PRECISION NOT NULL,
    turns_sum DOUBLE PRECISION NOT NULL,
    tokens_sum DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (run_id, policy_version, outcome)
);

-- The episodes recorded before.
INSERT INTO run_version_outcomes
    (run_id, policy_version, outcome, episodes, reward_sum, ndcg_sum, turns_sum, tokens_sum)
SELECT run_id, policy_version, outcome, COUNT(*), SUM(reward), SUM(ndcg),
       SUM(CAST(turns AS DOUBLE PRECISION)), SUM(CAST(tokens AS DOUBLE PRECISION))
FROM run_episodes GROUP BY run_id, policy_version, outcome;
