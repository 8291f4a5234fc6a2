//! How fast the dashboard answers on a big run: 1,000 learner steps,
//! 100,000 episodes (12,500 groups of 8), a validation every 10 steps, 200
//! runs to list, 103 evaluation reports of 200 tasks each; SQLite, as a
//! local install has it. Every page is fetched over HTTP on loopback, as a
//! browser would, and timed; the target is 100 ms.
//!
//! The episode page reads one group (a primary-key lookup) and decodes it:
//! its cost is that group's size, not the run's. So one group in 100 holds
//! realistic trajectories (8 episodes of ~2,600 tokens, 6 turns) and the
//! timed episode is one of them; the rest hold none, which keeps the
//! database small enough to fill in seconds.
//!
//! Bootstrap intervals are drawn once per report file and kept (a report
//! changes only when its job reruns): the evaluations pages are timed cold
//! (the first view) and warm.
//!
//!     cargo bench -p rollout-orchestrator --bench dashboard    (or `make bench`)

use std::time::{Duration, Instant};

use prost::Message;
use rollout_orchestrator::dashboard::Dashboard;
use rollout_orchestrator::evaluate::Evaluator;
use rollout_orchestrator::runs::Runner;
use rollout_orchestrator::state::State;
use rollout_orchestrator::workers::Workers;
use sleuth_proto::common::v1::{
    ChatMessage, Episode, EpisodeOutcome, SegmentKind, Task, ToolCall, Trace, TraceSegment, TrajectoryGroup,
};
use sleuth_proto::rollout::v1::{RunSpec, TrainingSpec, Validation};
use sleuth_store::{Database, RedisStore};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const RUN: &str = "big";
const STEPS: u64 = 1000;
const GROUPS: u64 = 12_500;
const GROUP_SIZE: u64 = 8;
const TASKS: usize = 200;
const TARGET_MS: f64 = 100.0;

fn segment(turn: u32, kind: SegmentKind, tokens: usize, version: u64) -> TraceSegment {
    let policy = kind == SegmentKind::Policy;
    TraceSegment {
        turn,
        kind: kind as i32,
        token_ids: (0..tokens as u32).map(|i| 200 + (i * 7919) % 48_000).collect(),
        loss_mask: vec![u8::from(policy); tokens],
        logprobs: if policy { (0..tokens).map(|i| -((i % 13) as f32) / 7.0).collect() } else { Vec::new() },
        policy_version: version,
        temperature: if policy { 0.7 } else { 0.0 },
    }
}

/// An episode of 6 turns: 5 searches with their observations, then a submission.
fn episode(id: String, version: u64, reward: f64) -> Episode {
    let observation = "[1] doc_id: d17 | A title\nA snippet of the document, long enough to be realistic. ".repeat(20);
    let mut messages = vec![
        ChatMessage { role: "system".into(), content: "You are a search agent. ".repeat(20), ..Default::default() },
        ChatMessage {
            role: "user".into(),
            content: "Who founded the company that makes oak barrels?".into(),
            ..Default::default()
        },
    ];
    let mut segments = vec![segment(0, SegmentKind::Prompt, 400, version)];
    for turn in 0..5u32 {
        let call = ToolCall {
            id: format!("call_{turn}"),
            name: "bm25_search".into(),
            arguments_json: format!("{{\"query\": \"oak barrels founder {turn}\", \"k\": 5}}"),
        };
        messages.push(ChatMessage { role: "assistant".into(), tool_calls: vec![call], ..Default::default() });
        messages.push(ChatMessage {
            role: "tool".into(),
            content: observation.clone(),
            tool_call_id: format!("call_{turn}"),
            name: "bm25_search".into(),
            ..Default::default()
        });
        segments.push(segment(turn, SegmentKind::Policy, 40, version));
        segments.push(segment(turn, SegmentKind::Observation, 400, version));
    }
    segments.push(segment(5, SegmentKind::Policy, 40, version));
    Episode {
        episode_id: id.clone(),
        task_id: "q17".into(),
        outcome: EpisodeOutcome::Completed as i32,
        messages,
        trace: Some(Trace { episode_id: id, segments, ..Default::default() }),
        ranking: (0..10).map(|d| format!("d{d}")).collect(),
        turns: 6,
        total_tokens: 2640,
        generated_tokens: 240,
        min_policy_version: version,
        max_policy_version: version,
        reward,
        metrics: [("ndcg@10".to_owned(), reward)].into(),
        ..Default::default()
    }
}

async fn fill(database: &Database, state: &State, reports: &std::path::Path) -> anyhow::Result<String> {
    let spec = RunSpec {
        name: "a big run".into(),
        group_size: GROUP_SIZE as u32,
        training: Some(TrainingSpec { eval_every: 10, ..Default::default() }),
        ..Default::default()
    };
    for run in 0..200 {
        state.create(&format!("run-{run:03}"), &spec).await?;
    }
    state.create(RUN, &spec).await?;
    let mut shown = String::new();
    let mut tx = database.pool().begin().await?;
    for group in 0..GROUPS {
        let version = group * STEPS / GROUPS;
        let group_id = format!("e0-q{group:05}");
        let ids: Vec<String> = (0..GROUP_SIZE).map(|i| format!("{RUN}-{group_id}-{i}")).collect();
        let rewards: Vec<f64> = (0..GROUP_SIZE).map(|i| ((group + i) % 5) as f64 / 4.0).collect();
        for (i, id) in ids.iter().enumerate() {
            let outcome = if (group + i as u64).is_multiple_of(23) {
                EpisodeOutcome::TurnLimit
            } else {
                EpisodeOutcome::Completed
            };
            sqlx::query(
                "INSERT INTO run_episodes (run_id, episode_id, group_id, task_id, outcome, reward, ndcg, turns, tokens, policy_version, trace_id)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
            )
            .bind(RUN)
            .bind(id)
            .bind(&group_id)
            .bind(format!("q{}", group % TASKS as u64))
            .bind(outcome as i32)
            .bind(rewards[i])
            .bind(rewards[i])
            .bind(6_i64)
            .bind(2640_i64)
            .bind(version as i64)
            .bind("0af7651916cd43dd8448eb211c80319c")
            .execute(&mut *tx)
            .await?;
        }
        let trajectories = (group % 100 == 50).then(|| {
            shown.clone_from(&ids[3]);
            TrajectoryGroup {
                run_id: RUN.into(),
                group_id: group_id.clone(),
                task: Some(Task {
                    task_id: "q17".into(),
                    question: "Who founded it?".into(),
                    collection: "c".into(),
                    qrels: [("d3".to_owned(), 2)].into(),
                    answers: Vec::new(),
                }),
                epoch: 0,
                episodes: ids.iter().zip(&rewards).map(|(id, &r)| episode(id.clone(), version, r)).collect(),
                policy_version: version,
            }
            .encode_to_vec()
        });
        sqlx::query(
            "INSERT INTO run_groups (run_id, group_id, stream_id, reward_mean, policy_version, trajectory) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(RUN)
        .bind(&group_id)
        .bind(format!("{group}-0"))
        .bind(rewards.iter().sum::<f64>() / GROUP_SIZE as f64)
        .bind(version as i64)
        .bind(trajectories)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO learner_groups (run_id, entry_id, group_id, step, disposition, detail, token_version) VALUES ($1, $2, $3, $4, 'trained', '', $5)",
        )
        .bind(RUN)
        .bind(format!("{group}-0"))
        .bind(&group_id)
        .bind(version as i64 + 1)
        .bind(version.saturating_sub(group % 2) as i64)
        .execute(&mut *tx)
        .await?;
    }
    for step in 1..=STEPS {
        let x = step as f64;
        let metrics = serde_json::json!({
            "step": step, "loss": 1.0 / x.sqrt(), "sequences": 100.0, "tokens": 264000.0, "trainable_fraction": 0.09,
            "clip_fraction": 0.02, "ratio_mean": 1.0, "ratio_max": 1.3, "kl": 0.001 * x.ln(), "entropy": 1.2 - x / 2000.0,
            "logprob_mismatch": 0.003, "grad_norm": 0.5 + (x / 50.0).sin().abs(), "learning_rate": 1e-6,
            "tokens_per_second": 9000.0, "advantage_mean": 0.0, "advantage_std": 0.9, "groups": 12,
            "groups_dropped_stale": 0, "groups_filtered": 1, "groups_rejected": 0, "publish_seconds": 0.4,
        });
        sqlx::query("INSERT INTO learner_steps (run_id, step, metrics, created_unix) VALUES ($1, $2, $3, 0)")
            .bind(RUN)
            .bind(step as i64)
            .bind(metrics.to_string())
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    std::fs::create_dir_all(reports)?;
    let report = |id: &str, contender: &str, level: f64| -> anyhow::Result<()> {
        let per_task: std::collections::BTreeMap<String, f64> =
            (0..TASKS).map(|t| (format!("q{t}"), (level + (t % 7) as f64 / 20.0).min(1.0))).collect();
        let json = serde_json::json!({
            "evaluation_id": id, "contender": contender, "collection": "c", "split": "validation",
            "samples_per_task": 1, "tasks": TASKS, "per_task_ndcg@10": per_task,
            "metrics": {"ndcg@10": level, "reward": level, "turns": 5.5, "tokens": 2600.0, "failure_rate:turn_limit": 0.02},
        });
        Ok(std::fs::write(reports.join(format!("{id}.json")), serde_json::to_vec(&json)?)?)
    };
    for version in (0..=STEPS).step_by(10) {
        let id = format!("{RUN}-validation-v{version}");
        report(&id, "policy", 0.2 + version as f64 / 2000.0)?;
        let validation = Validation {
            version,
            evaluation_id: id,
            metrics: [
                ("ndcg@10".to_owned(), 0.2 + version as f64 / 2000.0),
                ("failure_rate:turn_limit".to_owned(), 0.02),
            ]
            .into(),
        };
        state.record_validation(RUN, &validation).await?;
    }
    for (i, baseline) in ["baseline:bm25", "baseline:vector", "baseline:hybrid"].iter().enumerate() {
        report(&format!("eval-baseline-{i}"), baseline, 0.25)?;
    }
    Ok(shown)
}

/// One GET over a fresh connection; the time to the last byte.
async fn fetch(addr: std::net::SocketAddr, path: &str) -> anyhow::Result<(Duration, usize)> {
    let started = Instant::now();
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n").as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let took = started.elapsed();
    anyhow::ensure!(
        response.starts_with(b"HTTP/1.1 200"),
        "{path}: {}",
        String::from_utf8_lossy(&response[..response.len().min(300)])
    );
    Ok((took, response.len()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let database = Database::open(&format!("sqlite://{}", dir.path().join("runs.db").display()))?;
    let state = State::open(database.clone()).await?;
    let reports = dir.path().join("evaluations");
    let started = Instant::now();
    let episode = fill(&database, &state, &reports).await?;
    let size = std::fs::metadata(dir.path().join("runs.db"))?.len() as f64 / 1e9;
    println!(
        "dashboard: {STEPS} steps, {} episodes, 200 runs, {} reports; database {size:.2} GB, filled in {:.0} s",
        GROUPS * GROUP_SIZE,
        std::fs::read_dir(&reports)?.count(),
        started.elapsed().as_secs_f64()
    );
    let workers = Workers::new(&[], None, Duration::from_secs(1), None)?;
    let evaluator = Evaluator {
        tools: None,
        workers: workers.clone(),
        report_dir: reports.clone(),
        jobs: rollout_orchestrator::jobs::Jobs::new(reports.clone()),
        task_roots: sleuth_store::LocalRoots { roots: Vec::new(), setting: "SLEUTH_TASK_ROOTS" },
        judge: None,
    };
    let runner =
        Runner::new(state, RedisStore::open("redis://127.0.0.1:9/0")?, workers, evaluator, Duration::from_secs(1));
    let router = Dashboard::new(runner, database, reports, None).router(None);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, router).await });

    let last_page = GROUPS * GROUP_SIZE / 50 - 1;
    let pages = [
        ("runs", "/".to_owned()),
        ("run", format!("/runs/{RUN}")),
        ("run, last episodes page", format!("/runs/{RUN}?page={last_page}")),
        ("episode", format!("/runs/{RUN}/episodes/{episode}")),
        ("evaluations", "/evaluations".to_owned()),
        ("evaluations, paired", format!("/evaluations?against={RUN}-validation-v0")),
    ];
    println!(
        "{:<26} {:>8} {:>9} {:>9} {:>9} {:>8} {:>10}",
        "page", "cold ms", "median ms", "p95 ms", "max ms", "KiB", "p95/target"
    );
    for (name, path) in &pages {
        let (cold, _) = fetch(addr, path).await?;
        for _ in 0..2 {
            fetch(addr, path).await?;
        }
        let mut times = Vec::new();
        let mut bytes = 0;
        for _ in 0..20 {
            let (took, size) = fetch(addr, path).await?;
            times.push(took.as_secs_f64() * 1e3);
            bytes = size;
        }
        times.sort_by(f64::total_cmp);
        let (median, p95, max) = (times[times.len() / 2], times[(times.len() * 95) / 100 - 1], times[times.len() - 1]);
        println!(
            "{name:<26} {:>8.1} {median:>9.1} {p95:>9.1} {max:>9.1} {:>8.0} {:>10.2}",
            cold.as_secs_f64() * 1e3,
            bytes as f64 / 1024.0,
            p95 / TARGET_MS
        );
    }
    Ok(())
}
