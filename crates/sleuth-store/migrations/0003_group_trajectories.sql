-- Each published group keeps its trajectories (the encoded TrajectoryGroup
-- the learner was sent), so the orchestrator's dashboard can show any
-- episode's messages, tool calls and trained tokens after the learner has
-- trimmed the stream. NULL for groups recorded before.
ALTER TABLE run_groups ADD COLUMN trajectory BYTEA;
