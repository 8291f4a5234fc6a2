-- Each episode names its OpenTelemetry trace (32 hex digits; empty for
-- episodes recorded before, or by agents that export no traces).
ALTER TABLE run_episodes ADD COLUMN trace_id TEXT NOT NULL DEFAULT '';
