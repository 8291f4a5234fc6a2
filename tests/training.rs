//! The training loop closed, every part a real process: an orchestrator
//! fanning episodes out to two agent workers (tool gateway, inference
//! gateway, policy server behind them), a learner training on the groups
//! from the Redis stream and publishing each step's weights back to the
//! policy server, SQLite for both. The policy is imprinted to sample one of
//! three replies (two rankings, one malformed call), so groups differ in
//! reward, some are flat, and malformed calls happen.
//!
//! The test accounts for every group the orchestrator published: trained in
//! exactly one step or dropped with its reason, acknowledged, and sampled by
//! the weights its trace says (the learner's weights at that version give the
//! same logprobs as the policy server recorded).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use learner::records::{Disposition, GroupRecord};
use sleuth_proto::common::v1::{SamplingParams, SegmentKind, TrajectoryGroup};
use sleuth_proto::rollout::v1 as rollout;
use sleuth_tests::fixture::*;

const RUN: &str = "loop";
const BATCH: u64 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_training_run_closes_the_loop() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let Policies { index, mixed, .. } = policies(scratch.path()).await?;
    let mut mesh = Mesh::with_agents(&mixed, &index, 2)?;
    mesh.client().await?;
    let (orchestrator, mut client) = mesh.orchestrator(&scratch.path().join("runs.db")).await?;

    // Groups of 4, 2 per step, on-policy (staleness 0), every step checkpointed
    // (the test reads each version's weights back), sampled at temperature 1.
    let mut spec = spec(&index, 4, BATCH as u32, 8, 0, 3);
    spec.max_epochs = 8;
    spec.agent.as_mut().context("agent")?.sampling =
        Some(SamplingParams { temperature: Some(1.0), seed: Some(11), ..Default::default() });
    spec.training = Some(rollout::TrainingSpec { learning_rate: 1e-3, checkpoint_every: 1, ..Default::default() });
    let stream = StreamRecorder::start(&mesh.redis_url, RUN);
    client.create_run(rollout::CreateRunRequest { spec: Some(spec), run_id: RUN.into() }).await?;
    let mut learner = mesh.learner(RUN, scratch.path(), &orchestrator)?;

    // Mid-run the policy server restarts, on its base weights as version 0,
    // while the learner is paused (so nothing republishes): the episodes in
    // flight finish on version 0 and their groups must be dropped as stale.
    let redis = sleuth_store::RedisStore::open(&mesh.redis_url)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    let mut reported = std::time::Instant::now();
    loop {
        let run = client.get_run(rollout::GetRunRequest { run_id: RUN.into() }).await?.into_inner();
        let version = sleuth_store::trajectories::learner_version(&redis, RUN).await?;
        if reported.elapsed() > Duration::from_secs(10) {
            eprintln!("learner at version {version}; run {:?}", run.progress);
            reported = std::time::Instant::now();
        }
        if version >= 2 && run.progress.as_ref().is_some_and(|p| p.episodes_in_flight > 0) {
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the learner never reached version 2: {run:?}\nlearner log:\n{}\npolicy server log:\n{}",
            learner.log(),
            mesh.policy.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    learner.signal("STOP")?;
    mesh.restart_policy()?;
    wait_for(&mut client, RUN, Duration::from_secs(120), |run| {
        run.progress.as_ref().is_some_and(|p| p.episodes_in_flight == 0)
    })
    .await?;
    learner.signal("CONT")?;

    let finished =
        wait_for(&mut client, RUN, Duration::from_secs(400), |run| run.status != rollout::RunStatus::Running as i32)
            .await?;
    assert_eq!(finished.status, rollout::RunStatus::Succeeded as i32, "{}", finished.status_detail);
    // The learner sees the run is over, trains the rest and exits.
    let (exit, _) = learner.wait(Duration::from_secs(120))?;
    assert!(exit.success(), "learner exited with {exit}; log:\n{}", learner.log());

    // Every published group: trained in exactly one step, or dropped with its reason.
    tokio::time::sleep(Duration::from_millis(100)).await; // the recorder's last look
    let entries = stream.entries();
    assert_eq!(entries.len() as u64, published(&finished), "entries seen in the stream");
    let database = sleuth_store::Database::open(&format!("sqlite://{}", scratch.path().join("learner.db").display()))?;
    let records = learner::records::groups(&database, RUN).await?;
    let recorded: BTreeMap<&str, &GroupRecord> = records.iter().map(|r| (r.entry_id.as_str(), r)).collect();
    assert_eq!(recorded.len(), records.len());
    for (id, group) in &entries {
        let record =
            recorded.get(id.as_str()).with_context(|| format!("group {} ({id}) never accounted", group.group_id))?;
        assert_eq!(record.group_id, group.group_id);
    }
    assert_eq!(records.len(), entries.len(), "records of entries not in the stream");
    let count = |d: Disposition| records.iter().filter(|r| r.disposition == d).count();
    let steps: BTreeSet<u64> =
        records.iter().filter(|r| r.disposition == Disposition::Trained).map(|r| r.step).collect();
    let last = *steps.last().context("nothing trained")?;
    assert!(last >= 8, "{last} learner steps");
    assert_eq!(steps, (1..=last).collect(), "every step trained some groups");
    for step in 1..=last {
        let trained = records.iter().filter(|r| r.disposition == Disposition::Trained && r.step == step).count() as u64;
        assert!(trained == BATCH || (step == last && trained < BATCH), "step {step} trained {trained} groups");
    }
    assert!(count(Disposition::Flat) >= 1, "no flat group: {records:#?}");
    assert!(count(Disposition::Stale) >= 1, "the restarted policy server's groups were not dropped: {records:#?}");
    assert_eq!(count(Disposition::Rejected), 0, "{records:#?}");
    for record in &records {
        match record.disposition {
            // On-policy: every trained token was sampled by the weights the step started from.
            Disposition::Trained => assert_eq!(record.token_version, record.step - 1, "{record:?}"),
            Disposition::Stale => assert!(record.token_version < record.step - 1, "{record:?}"),
            _ => {}
        }
    }
    let malformed = entries
        .iter()
        .flat_map(|(_, g)| &g.episodes)
        .flat_map(|e| &e.messages)
        .filter(|m| m.role == "tool" && m.content == agent::episode::MALFORMED_CALL)
        .count();
    assert!(malformed >= 1, "no malformed tool call was made");

    // The run's final state: steps recorded, checkpoint sealed, nothing pending.
    let steps_recorded = learner::records::steps(&database, RUN).await?;
    assert_eq!(steps_recorded.len() as u64, last);
    let checkpoints = scratch.path().join("checkpoints");
    assert!(checkpoints.join(format!("{}/COMPLETE", learner::checkpoint::step_dir(last))).is_file());
    let connection = &mut redis::Client::open(mesh.redis_url.as_str())?.get_multiplexed_async_connection().await?;
    let pending: redis::streams::StreamPendingReply = redis::AsyncCommands::xpending(
        connection,
        sleuth_store::trajectories::stream_key(RUN),
        sleuth_store::trajectories::LEARNER_GROUP,
    )
    .await?;
    assert_eq!(pending.count(), 0, "entries left unacknowledged");

    // The versions in the traces are the weights that sampled them.
    let checked = check_token_versions(&entries, &mesh.model, &checkpoints, last)?;
    eprintln!(
        "closed loop: {} groups, {last} steps, {} trained, {} flat, {} stale; {malformed} malformed calls; \
         {checked} sampled segments match their version's logprobs",
        entries.len(),
        count(Disposition::Trained),
        count(Disposition::Flat),
        count(Disposition::Stale)
    );
    Ok(())
}

/// For every sampled segment of every trained group, the logprobs of its
/// tokens under the weights of the version it names (the base model for 0,
/// the learner's checkpoint export for the others) equal the ones the policy
/// server recorded, within 1e-4; under the previous version's weights they do
/// not (so the check can tell versions apart). Returns the segments checked.
fn check_token_versions(
    entries: &[(String, TrajectoryGroup)],
    base: &Path,
    checkpoints: &Path,
    last: u64,
) -> Result<usize> {
    let weights = |version: u64| -> PathBuf {
        if version == 0 { base.to_owned() } else { checkpoints.join(learner::checkpoint::step_dir(version)).join("hf") }
    };
    let models: Vec<Scorer> = (0..=last).map(|v| Scorer::load(&weights(v))).collect::<Result<_>>()?;
    let (mut checked, mut told_apart) = (0, 0);
    for episode in entries.iter().flat_map(|(_, g)| &g.episodes) {
        let Some(trace) = &episode.trace else { continue };
        let tokens: Vec<i64> = trace.segments.iter().flat_map(|s| s.token_ids.iter().map(|&t| i64::from(t))).collect();
        let mut at = 0;
        for segment in &trace.segments {
            let span = at..at + segment.token_ids.len();
            at = span.end;
            if segment.kind != SegmentKind::Policy as i32 || segment.token_ids.is_empty() {
                continue;
            }
            let version = segment.policy_version;
            let model =
                models.get(version as usize).with_context(|| format!("version {version} > last step {last}"))?;
            let ours = model.logprobs(&tokens[..span.end], span.start)?;
            let worst = max_gap(&ours, &segment.logprobs);
            assert!(worst < 1e-4, "{}: segment at version {version} differs by {worst}", episode.episode_id);
            checked += 1;
            if version >= 1 {
                let before = models[version as usize - 1].logprobs(&tokens[..span.end], span.start)?;
                told_apart += usize::from(max_gap(&before, &segment.logprobs) > 1e-3);
            }
        }
    }
    assert!(told_apart >= 1, "no segment's logprobs tell its version from the previous one");
    Ok(checked)
}

fn max_gap(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// A model on the CPU in f32, as the learner and the policy server run it.
struct Scorer {
    model: sleuth_model::Model,
    _vars: tch::nn::VarStore,
}

impl Scorer {
    fn load(dir: &Path) -> Result<Self> {
        let config = sleuth_model::Config::from_file(&dir.join("config.json"))?;
        let mut vars = tch::nn::VarStore::new(tch::Device::Cpu);
        let model = sleuth_model::Model::new(&vars.root(), &config);
        sleuth_model::load_weights(&mut vars, dir)?;
        Ok(Self { model, _vars: vars })
    }

    /// The logprob of each token of `tokens[from..]` given the ones before it.
    fn logprobs(&self, tokens: &[i64], from: usize) -> Result<Vec<f32>> {
        tch::no_grad(|| {
            let input = tch::Tensor::from_slice(tokens).unsqueeze(0);
            let logits = self.model.forward(&input, None).get(0).log_softmax(-1, tch::Kind::Float);
            let n = (tokens.len() - from) as i64;
            let predicted = logits.narrow(0, from as i64 - 1, n);
            let targets = tch::Tensor::from_slice(&tokens[from..]).unsqueeze(-1);
            Ok(Vec::<f32>::try_from(predicted.gather(-1, &targets, false).squeeze_dim(-1))?)
        })
    }
}
