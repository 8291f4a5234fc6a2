//! Scripted teachers through the real mesh (agent worker, inference
//! gateway, tool gateway, policy server) on the synthetic multi-hop
//! collection: a teacher that follows bridges finds the answer three
//! searches away, and its turns are traced as the policy's own tokens.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use sleuth_metrics::reward::{NdcgReward, Reward};
use sleuth_proto::agent::v1::{AgentConfig, RunEpisodeRequest};
use sleuth_proto::common::v1::{Episode, EpisodeOutcome, SegmentKind, Task};
use sleuth_tests::fixture::*;

/// The synthetic collection (8 companies), indexed for BM25, and its questions with their qrels.
fn synth(dir: &std::path::Path) -> Result<(std::path::PathBuf, Vec<Task>)> {
    let source = dir.join("synth");
    sleuth_beir::synth::write(&source, sleuth_beir::synth::SynthSpec { seed: 3, companies: 8 })?;
    let index = dir.join("synth-index");
    index_collection(&source, &index, "synth", false)?;
    let beir = sleuth_beir::BeirDir::new(&source);
    let qrels: BTreeMap<String, BTreeMap<String, i32>> = ["train", "validation", "test"]
        .iter()
        .map(|s| beir.qrels(s))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .flatten()
        .collect();
    let tasks = beir
        .queries(sleuth_beir::BadLines::Fail)?
        .into_iter()
        .map(|q| Task {
            qrels: qrels.get(&q.id).cloned().unwrap_or_default().into_iter().collect(),
            task_id: q.id,
            question: q.text,
            collection: "synth".into(),
        })
        .collect();
    Ok((index, tasks))
}

async fn taught(mesh: &Mesh, task: &Task, teacher: &str, episode: &str) -> Result<Episode> {
    let request = RunEpisodeRequest {
        run_id: "teach".into(),
        episode_id: episode.into(),
        sample_index: 0,
        task: Some(task.clone()),
        config: Some(AgentConfig {
            budget: Some(sleuth_proto::common::v1::AgentBudget {
                max_turns: 6,
                max_new_tokens_per_turn: 128,
                max_episode_tokens: 8192,
                observation_char_cap: 4000,
            }),
            teacher: teacher.into(),
            ..Default::default()
        }),
    };
    mesh.client().await?.run_episode(request).await?.into_inner().episode.context("episode")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teacher_follows_bridges_to_the_answer_and_is_traced_as_the_policy() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (index, tasks) = synth(scratch.path())?;
    let mesh = Mesh::with_collection(&sleuth_testkit::smollm2()?, "synth", &index, 1)?;
    let reward = NdcgReward::with_penalties(&BTreeMap::new()).map_err(anyhow::Error::msg)?;

    let river = tasks.iter().find(|t| t.task_id.ends_with("founder_river")).context("a 3-hop question")?;
    let answer = river.qrels.iter().find(|(_, g)| **g == 2).map(|(d, _)| d.clone()).context("answer")?;
    let mut episode = taught(&mesh, river, "bm25:2", "teach-river").await?;
    assert_eq!(episode.outcome, EpisodeOutcome::Completed as i32, "{}", episode.outcome_detail);
    assert_eq!(episode.turns, 4, "search the question, the founder, the town; submit");
    assert_eq!(episode.ranking.first(), Some(&answer), "the town's document first: {:?}", episode.ranking);
    let scored = reward.score(river, &episode);
    // The bridges rank below the town's other mentions (its distractors).
    assert!(scored.reward > 0.8, "nDCG@10 {} for {:?}", scored.reward, episode.ranking);

    // Every assistant turn is a policy segment: trainable tokens, logprobs 0.
    let trace = episode.trace.take().context("trace")?;
    let policy: Vec<_> = trace.segments.iter().filter(|s| s.kind == SegmentKind::Policy as i32).collect();
    assert_eq!(policy.len(), 4);
    assert!(policy.iter().all(|s| s.loss_mask.iter().all(|&m| m == 1) && s.logprobs.iter().all(|&l| l == 0.0)));
    assert_eq!(trace.drift_events, 0, "the teacher's turns re-render to their own tokens");

    // Searching the question alone finds the company's documents, not the town's.
    let once = taught(&mesh, river, "bm25:0", "teach-once").await?;
    assert_eq!(once.turns, 2);
    assert!(!once.ranking.contains(&answer), "{:?}", once.ranking);

    // A mixture completes every question type.
    for task in tasks.iter().take(4) {
        let episode = taught(&mesh, task, "mixture", &format!("teach-mix-{}", task.task_id)).await?;
        assert_eq!(episode.outcome, EpisodeOutcome::Completed as i32, "{}: {}", task.task_id, episode.outcome_detail);
    }
    Ok(())
}
