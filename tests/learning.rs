//! Learning, end to end: on the synthetic multi-hop collection, a fresh
//! tiny policy (copy pre-trained, the fixture) trained by a Sleuth run
//! through the real mesh (teacher episodes through agent workers and the
//! inference gateway, a learner publishing weights to the policy server)
//! scores a higher validation nDCG@10 than it did untrained. The test fails
//! when learning breaks anywhere on that path.

use std::time::Duration;

use anyhow::{Context, Result};
use sleuth_proto::agent::v1::AgentConfig;
use sleuth_proto::common::v1::{AgentBudget, SamplingParams};
use sleuth_proto::rollout::v1 as rollout;
use sleuth_tests::fixture::*;

/// Questions of the train split the run learns from, and of the validation
/// split it is scored on.
const TRAIN_TASKS: u32 = 160;
const VALIDATION_TASKS: u32 = 64;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trajectory_sft_raises_validation_ndcg_above_the_base() -> Result<()> {
    const RUN: &str = "learn";
    let base = learning_base()?;
    let scratch = tempfile::tempdir()?;
    let (source, index) = synth_collection(scratch.path())?;
    let mesh = Mesh::with_collection(&base, "synth", &index, 2)?;
    mesh.client().await?;
    let database = scratch.path().join("runs.db");
    let (orchestrator, mut client) = mesh.orchestrator(&database).await?;
    let tasks = |split: &str, limit: u32| rollout::TaskSet {
        source_uri: source.display().to_string(),
        collection: "synth".into(),
        split: split.into(),
        limit,
    };
    let spec = rollout::RunSpec {
        name: RUN.into(),
        train: Some(tasks("train", TRAIN_TASKS)),
        validation: Some(tasks("validation", VALIDATION_TASKS)),
        agent: Some(AgentConfig {
            budget: Some(AgentBudget {
                max_turns: 5,
                max_new_tokens_per_turn: 96,
                max_episode_tokens: 6144,
                observation_char_cap: 2000,
            }),
            sampling: Some(SamplingParams { seed: Some(11), ..Default::default() }),
            teacher: "mixture".into(),
            tools: vec![TOOLS.into()],
            opening_search: TOOLS.into(),
            ..Default::default()
        }),
        group_size: 2,
        global_batch_size: 8,
        // Validation first rises between versions 20 and 40 (measured: 0.000,
        // 0.000, 0.186 at 0, 10, 20 after two epochs; 0.222 at 30 and 0.448 at
        // 40 in the demo's longer run): three epochs validate up to 40.
        max_epochs: 3,
        rollout_max_concurrency: 8,
        max_staleness: 1,
        training: Some(rollout::TrainingSpec {
            learning_rate: 2e-3,
            checkpoint_every: 10,
            eval_every: 10,
            sft_min_reward: 0.3,
            ..Default::default()
        }),
        ..Default::default()
    };
    client.create_run(rollout::CreateRunRequest { spec: Some(spec), run_id: RUN.into() }).await?;
    let mut learner = mesh.learner(RUN, scratch.path(), &database, &orchestrator)?;
    let finished =
        wait_for(&mut client, RUN, Duration::from_secs(900), |run| run.status != rollout::RunStatus::Running as i32)
            .await?;
    assert_eq!(finished.status, rollout::RunStatus::Succeeded as i32, "{}", finished.status_detail);
    let (exit, _) = learner.wait(Duration::from_secs(300))?;
    assert!(exit.success(), "learner exited with {exit}; log:\n{}", learner.log());

    let report = std::process::Command::new(sleuth_tests::binary("sleuth")?)
        .args(["run", "report", RUN, "--orchestrator", &orchestrator.addr, "--png"])
        .arg(scratch.path().join("learn.png"))
        .output()?;
    let table = String::from_utf8_lossy(&report.stdout).into_owned();
    eprintln!("{table}");
    let ndcg = |version: u64| {
        finished.validations.iter().find(|v| v.version == version).and_then(|v| v.metrics.get("ndcg@10").copied())
    };
    let untrained = ndcg(0).context("the untrained base is validated first")?;
    let best = ndcg(finished.best_version).context("the best version is a validated one")?;
    assert!(
        best > untrained + 0.05,
        "validation nDCG@10 rose from {untrained:.3} (base) to only {best:.3} (version {}):\n{table}",
        finished.best_version
    );

    // The best version's validation is an evaluation like any other: per
    // question, to compare with another run's on the same questions.
    let validation = finished.validations.iter().find(|v| v.version == finished.best_version).context("validated")?;
    let request = rollout::GetEvaluationRequest { evaluation_id: validation.evaluation_id.clone() };
    let evaluation = client.get_evaluation(request).await?.into_inner();
    let per_question: Vec<f64> =
        evaluation.per_task.values().filter_map(|m| m.metrics.get("ndcg@10").copied()).collect();
    assert_eq!(per_question.len(), VALIDATION_TASKS as usize, "{evaluation:?}");
    let mean = per_question.iter().sum::<f64>() / per_question.len() as f64;
    assert!((mean - best).abs() < 1e-9, "the per-question scores average to the validation's {best}, not {mean}");
    Ok(())
}
