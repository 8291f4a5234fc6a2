-- A run's progress lives in its record, beside its status and the reason for
-- it, so every reader (GetRun, ListRuns, WatchRun, the dashboard, the
-- learner asking whether the run is over), and an orchestrator restarted
-- after the run ended, reads the three as one consistent thing. The counters
-- are bumped in the transaction that records each group and episode.
ALTER TABLE runs ADD COLUMN groups_total BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN groups_published BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN episodes_finished BIGINT NOT NULL DEFAULT 0;

-- The groups and episodes recorded before (the total is counted again when
-- a run is next driven).
UPDATE runs SET
    groups_published = (SELECT COUNT(*) FROM run_groups g WHERE g.run_id = runs.run_id),
    episodes_finished = (SELECT COUNT(*) FROM run_episodes e WHERE e.run_id = runs.run_id);
