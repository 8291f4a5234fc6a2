//! Scripted teachers through the real mesh (agent worker, inference
//! gateway, tool gateway, policy server) on the synthetic multi-hop
//! collection: the mixture's best episode follows the founder from the
//! question's results and beats searching the question alone, and a
//! teacher's turns are traced as the policy's own tokens.

use std::collections::BTreeMap;
use std::ops::Not as _;

use anyhow::{Context, Result};
use sleuth_metrics::reward::{NdcgReward, Reward};
use sleuth_proto::agent::v1::{AgentConfig, RunEpisodeRequest};
use sleuth_proto::common::v1::{Episode, EpisodeOutcome, SegmentKind, Task};
use sleuth_tests::fixture::*;

async fn taught(mesh: &Mesh, task: &Task, teacher: &str, episode: &str) -> Result<Episode> {
    opened(mesh, task, teacher, "", episode).await
}

/// An episode of `teacher` that the agent opens by searching the question with `opening_search`.
async fn opened(mesh: &Mesh, task: &Task, teacher: &str, opening_search: &str, episode: &str) -> Result<Episode> {
    played(mesh, task, teacher, opening_search, 0, &[], episode).await
}

/// Episode `sample` of a group of the mixture teacher searching with BM25
/// (the sample deals out its way).
async fn mixed(mesh: &Mesh, task: &Task, opening_search: &str, sample: u32, episode: &str) -> Result<Episode> {
    played(mesh, task, "mixture", opening_search, sample, &["bm25_search"], episode).await
}

async fn played(
    mesh: &Mesh,
    task: &Task,
    teacher: &str,
    opening_search: &str,
    sample: u32,
    tools: &[&str],
    episode: &str,
) -> Result<Episode> {
    let request = RunEpisodeRequest {
        run_id: "teach".into(),
        episode_id: episode.into(),
        sample_index: sample,
        task: Some(task.clone()),
        config: Some(AgentConfig {
            budget: Some(sleuth_proto::common::v1::AgentBudget {
                max_turns: 6,
                max_new_tokens_per_turn: 128,
                max_episode_tokens: 8192,
                observation_char_cap: 4000,
            }),
            teacher: teacher.into(),
            opening_search: opening_search.into(),
            tools: tools.iter().map(|t| (*t).to_owned()).collect(),
            ..Default::default()
        }),
        ticket: String::new(),
        group_id: "teach".into(),
    };
    mesh.client().await?.run_episode(sleuth_tests::ticketed(request)).await?.into_inner().episode.context("episode")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mixtures_best_episode_follows_the_founder_and_is_traced_as_the_policy() -> Result<()> {
    let scratch = tempfile::tempdir()?;
    let (index, tasks) = small_synth(scratch.path())?;
    let mesh = Mesh::with_collection(&sleuth_testkit::smollm2()?, "synth", &index, 1)?;
    let reward = NdcgReward::default();

    let river = tasks.iter().find(|t| t.task_id.ends_with("founder_river")).context("a 3-hop question")?;
    let answer = river.qrels.iter().find(|(_, g)| **g == 2).map(|(d, _)| d.clone()).context("answer")?;
    // A group of 13 plays the question every way of the mixture (0 to 2
    // hops, each following one of the 3 most salient bridges); the best by
    // reward, which trajectory SFT keeps, follows the founder and the town
    // to the answer.
    let mut best: Option<(f64, u32, Episode)> = None;
    for sample in 0..13 {
        let episode = mixed(&mesh, river, "", sample, &format!("teach-river-{sample}")).await?;
        assert_eq!(episode.outcome, EpisodeOutcome::Completed as i32, "{}", episode.outcome_detail);
        let reward = reward.score(river, &episode).reward;
        if best.as_ref().is_none_or(|(top, _, _)| reward > *top) {
            best = Some((reward, sample, episode));
        }
    }
    let (best_reward, best_sample, mut episode) = best.context("episodes")?;
    let said: Vec<&str> = episode.messages.iter().map(|m| m.content.as_str()).collect();
    // Its first bridge is the founder: the question's results name the
    // founder twice and title a document with the name.
    let titles: BTreeMap<String, String> = sleuth_beir::BeirDir::new(scratch.path().join("synth"))
        .corpus(sleuth_beir::BadLines::Fail)?
        .map(|d| d.map(|d| (d.id, d.title)))
        .collect::<Result<_, _>>()?;
    let founder = river
        .qrels
        .iter()
        .filter(|(_, grade)| **grade == 1)
        .map(|(doc, _)| &titles[doc])
        .find(|title| river.question.contains(title.as_str()).not())
        .context("the founder's name")?;
    let searched: Vec<&str> =
        episode.messages.iter().flat_map(|m| &m.tool_calls).map(|c| c.arguments_json.as_str()).collect();
    assert!(searched.get(1).is_some_and(|call| call.contains(founder.as_str())), "{founder}: {said:#?}");

    // Every assistant turn is a policy segment: trainable tokens, logprobs 0.
    let trace = episode.trace.take().context("trace")?;
    let policy: Vec<_> = trace.segments.iter().filter(|s| s.kind == SegmentKind::Policy as i32).collect();
    assert_eq!(policy.len() as u32, episode.turns);
    assert!(policy.iter().all(|s| s.loss_mask.iter().all(|&m| m == 1) && s.logprobs.iter().all(|&l| l == 0.0)));
    assert_eq!(trace.drift_events, 0, "the teacher's turns re-render to their own tokens");

    // Searching the question alone scores below the best way the mixture found.
    let once = taught(&mesh, river, "bm25:0", "teach-once").await?;
    assert_eq!(once.turns, 2);
    assert!(!once.ranking.contains(&answer), "{:?}", once.ranking);
    assert!(reward.score(river, &once).reward < best_reward, "{best_reward}: {said:#?}");

    // Opened by the agent's search of the question, the teacher's turns are
    // its bridges and the submission; the opening is prompt, not policy.
    let mut opened_river = mixed(&mesh, river, "bm25_search", best_sample, "teach-opened").await?;
    assert_eq!(opened_river.turns, episode.turns - 1, "{:?}", opened_river.messages);
    let opening = &opened_river.messages[2];
    assert_eq!((opening.role.as_str(), opening.tool_calls[0].name.as_str()), ("assistant", "bm25_search"));
    assert!(opening.tool_calls[0].arguments_json.contains(&river.question), "{:?}", opening.tool_calls);
    assert_eq!(opened_river.ranking, episode.ranking, "the same searches, the same ranking");
    let trace = opened_river.trace.take().context("trace")?;
    let policy = trace.segments.iter().filter(|s| s.kind == SegmentKind::Policy as i32).count();
    assert_eq!(policy as u32, opened_river.turns);
    assert_eq!(trace.drift_events, 0);
    // Offered follow_lead, a hop follows lead 1 (the bridge it searched by
    // name), which the agent searches with BM25: the same ranking.
    let named = opened(&mesh, river, "bm25:2", "bm25_search", "teach-named").await?;
    let tools = ["bm25_search", "follow_lead"];
    let followed = played(&mesh, river, "bm25:2", "bm25_search", 0, &tools, "teach-followed").await?;
    let said: Vec<&str> = followed.messages.iter().map(|m| m.content.as_str()).collect();
    assert_eq!(followed.outcome, EpisodeOutcome::Completed as i32, "{}", followed.outcome_detail);
    assert_eq!(followed.ranking, named.ranking, "{said:#?}");
    let calls: Vec<(&str, &str)> = followed
        .messages
        .iter()
        .flat_map(|m| &m.tool_calls)
        .map(|c| (c.name.as_str(), c.arguments_json.as_str()))
        .collect();
    assert_eq!(calls[1..3], [("follow_lead", r#"{"n":1}"#), ("follow_lead", r#"{"n":1}"#)], "{said:#?}");
    let lead = sleuth_chat::observation::parse_leads(&followed.messages[3].content);
    assert!(lead.first().is_some_and(|lead| lead == founder), "{founder}: {said:#?}");
    assert!(followed.messages[5].content.starts_with(&format!("bm25_search results for \"{founder}\"")), "{said:#?}");
    let absent = opened(&mesh, river, "bm25:2", "vector_search", "teach-no-vectors").await?;
    assert_eq!(absent.outcome, EpisodeOutcome::ToolError as i32);
    assert!(absent.outcome_detail.contains("opening_search \"vector_search\""), "{}", absent.outcome_detail);

    // A mixture completes every question type.
    for task in tasks.iter().take(4) {
        let episode = taught(&mesh, task, "mixture", &format!("teach-mix-{}", task.task_id)).await?;
        assert_eq!(episode.outcome, EpisodeOutcome::Completed as i32, "{}: {}", task.task_id, episode.outcome_detail);
    }
    Ok(())
}

/// Trajectory SFT from one spec: a teacher writes the episodes (agent.teacher),
/// the learner sees a teacher's run and imitates the episodes rewarded at
/// least `sft_min_reward`, recording the others as below it. The policy is a
/// tiny random Llama (the teacher replies, so it never generates); its loss
/// on the teacher's tokens falls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sft_run_imitates_the_teachers_best_episodes_from_one_spec() -> Result<()> {
    use learner::records::Disposition;
    use sleuth_proto::rollout::v1 as rollout;
    const RUN: &str = "sft";
    let scratch = tempfile::tempdir()?;
    let (mesh, _) = teacher_mesh(scratch.path(), 2)?;
    mesh.client().await?;
    let (orchestrator, mut client) = mesh.orchestrator(&scratch.path().join("runs.db")).await?;
    let spec = rollout::RunSpec {
        name: "sft".into(),
        train: Some(rollout::TaskSet {
            source_uri: scratch.path().join("synth").display().to_string(),
            collection: "synth".into(),
            split: "train".into(),
            limit: 0,
        }),
        agent: Some(AgentConfig {
            budget: Some(sleuth_proto::common::v1::AgentBudget {
                max_turns: 6,
                max_new_tokens_per_turn: 128,
                max_episode_tokens: 8192,
                observation_char_cap: 1500,
            }),
            sampling: Some(sleuth_proto::common::v1::SamplingParams { seed: Some(5), ..Default::default() }),
            teacher: "mixture".into(),
            tools: vec!["bm25_search".into()],
            ..Default::default()
        }),
        group_size: 2,
        global_batch_size: 2,
        max_epochs: 1,
        rollout_max_concurrency: 4,
        max_staleness: 1,
        validation: Some(rollout::TaskSet {
            source_uri: scratch.path().join("synth").display().to_string(),
            collection: "synth".into(),
            split: "validation".into(),
            limit: 0,
        }),
        training: Some(rollout::TrainingSpec {
            learning_rate: 1e-3,
            lr_schedule: "cosine".into(),
            copy_rehearsal: 4,
            checkpoint_every: 2,
            eval_every: 2,
            sft_min_reward: 0.5,
            ..Default::default()
        }),
        ..Default::default()
    };
    let stream = StreamRecorder::start(&mesh.redis_url, RUN);
    client.create_run(rollout::CreateRunRequest { spec: Some(spec), run_id: RUN.into() }).await?;
    let mut learner = mesh.learner(RUN, scratch.path(), &scratch.path().join("runs.db"), &orchestrator)?;
    let finished = wait_for(&mut client, RUN, std::time::Duration::from_secs(400), |run| {
        run.status != rollout::RunStatus::Running as i32
    })
    .await?;
    assert_eq!(finished.status, rollout::RunStatus::Succeeded as i32, "{}", finished.status_detail);
    let (exit, _) = learner.wait(std::time::Duration::from_secs(300))?;
    assert!(exit.success(), "learner exited with {exit}; log:\n{}", learner.log());
    assert!(learner.log().contains("trajectory SFT batch"), "the spec made it an SFT run");

    // The policy itself (greedy, not the teacher) was validated at the start,
    // then every 2 versions, then at the version the learner ended on
    // (before the run ended); a random policy fails every episode.
    // The learner waits for each, so none is missing and each is of its version alone.
    let versions: Vec<u64> = finished.validations.iter().map(|v| v.version).collect();
    assert_eq!(versions.first(), Some(&0), "the untrained start is validated: {:?}", finished.validations);
    let (last, every_2) = versions.split_last().context("validations")?;
    assert!(every_2.windows(2).all(|w| w[1] == w[0] + 2) && every_2.len() >= 2, "{versions:?}");
    validations_are_of_their_version(&finished)?;
    let redis = sleuth_store::RedisStore::open(&mesh.redis_url)?;
    let ended_on = sleuth_store::trajectories::learner_version(&redis, RUN).await?;
    assert_eq!(*last, ended_on, "the last version is validated: {versions:?}");
    for validation in &finished.validations {
        assert_eq!(validation.metrics.get("ndcg@10"), Some(&0.0), "{validation:?}");
        let report = scratch.path().join("evaluations").join(format!("{}.json", validation.evaluation_id));
        assert!(report.is_file(), "{} missing", report.display());
    }
    assert!(versions.contains(&finished.best_version));

    // The run's learning curve, as `sleuth run report` prints it: the
    // teacher's episodes (version 0) beside the validations.
    let trained: u64 = finished.training.iter().map(|t| t.episodes).sum();
    assert_eq!(trained, finished.progress.as_ref().map_or(0, |p| p.episodes_finished));
    let (csv, png) = (scratch.path().join("curve.csv"), scratch.path().join("curve.png"));
    let report = std::process::Command::new(sleuth_tests::binary("sleuth")?)
        .args(["run", "report", RUN, "--orchestrator", &orchestrator.addr, "--csv"])
        .arg(&csv)
        .arg("--png")
        .arg(&png)
        .output()?;
    let table = String::from_utf8_lossy(&report.stdout);
    assert!(report.status.success(), "{table}{}", String::from_utf8_lossy(&report.stderr));
    assert!(table.contains("best version by validation score"), "{table}");
    assert_eq!(std::fs::read_to_string(&csv)?.lines().count(), 1 + versions.len(), "{table}");
    assert!(std::fs::read(&png)?.starts_with(b"\x89PNG"), "the chart is written: {table}");
    eprintln!("{table}");

    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let entries: BTreeMap<String, _> = stream.entries().into_iter().collect();
    let database = sleuth_store::Database::open(&format!("sqlite://{}", scratch.path().join("runs.db").display()))?;
    let records = learner::records::groups(&database, RUN).await?;
    assert_eq!(records.len(), entries.len(), "every group accounted");
    let best = |id: &str| entries[id].episodes.iter().map(|e| e.reward).fold(f64::MIN, f64::max);
    for record in &records {
        match record.disposition {
            Disposition::Trained => assert!(best(&record.entry_id) >= 0.5, "{record:?}"),
            Disposition::BelowMinReward => assert!(best(&record.entry_id) < 0.5, "{record:?}"),
            other => panic!("teacher data is neither stale nor flat: {other:?} {record:?}"),
        }
    }
    let count = |d: Disposition| records.iter().filter(|r| r.disposition == d).count();
    assert!(count(Disposition::Trained) >= 4 && count(Disposition::BelowMinReward) >= 1, "{records:#?}");
    // The orchestrator names each episode's group to the agent, and the
    // mixture deals its ways over a group from a start the group's id
    // draws: groups do not all play the same way with their first sample
    // (without the id, every group's sample 0 took the same number of turns).
    let plays: std::collections::BTreeSet<Vec<u32>> = entries
        .values()
        .map(|group| {
            let mut turns: Vec<(u32, u32)> = group.episodes.iter().map(|e| (e.sample_index, e.turns)).collect();
            turns.sort_unstable();
            turns.into_iter().map(|(_, turns)| turns).collect()
        })
        .collect();
    assert!(plays.len() > 1, "every group played its samples alike: {plays:?}");

    let steps = learner::records::steps(&database, RUN).await?;
    let loss = |i: usize| steps[i].1["loss"].as_f64().unwrap_or(f64::NAN);
    assert!(steps.len() >= 2, "{steps:?}");
    assert!(loss(steps.len() - 1) < loss(0), "the loss on the teacher's tokens falls: {steps:?}");
    // Every step rehearsed 4 copy conversations read by the learner from
    // train.source_uri beside at most 4 teacher episodes (2 groups of 2).
    let sequences: Vec<f64> = steps.iter().filter_map(|(_, m)| m["sequences"].as_f64()).collect();
    assert!(!sequences.is_empty() && sequences.iter().all(|n| *n >= 5.0), "sequences per step {sequences:?}");
    // The learning rate followed its cosine over the run's planned steps.
    let rates: Vec<f64> = steps.iter().filter_map(|(_, m)| m["learning_rate"].as_f64()).collect();
    let (peak, last) = (rates.iter().copied().fold(0.0, f64::max), rates.last().copied().unwrap_or_default());
    assert!(peak <= 1e-3 + 1e-12 && last < peak && last >= 1e-4 - 1e-12, "learning rates {rates:?}");
    eprintln!(
        "sft: {} groups, {} trained, {} below min reward, {} steps, loss {:.3} -> {:.3}, validated versions {versions:?}",
        records.len(),
        count(Disposition::Trained),
        count(Disposition::BelowMinReward),
        steps.len(),
        loss(0),
        loss(steps.len() - 1)
    );

    // GRPO after SFT, named by the SFT run alone: its learner finds the SFT
    // run's best validated version that has a checkpoint in the shared store
    // (every run has its own folder there) and publishes it as its first version.
    let mut grpo = rollout::RunSpec {
        name: "grpo-after-sft".into(),
        train: Some(rollout::TaskSet {
            limit: 2,
            ..finished.spec.as_ref().and_then(|s| s.train.clone()).context("the SFT run's train tasks")?
        }),
        agent: Some(AgentConfig {
            budget: Some(sleuth_proto::common::v1::AgentBudget {
                max_turns: 2,
                max_new_tokens_per_turn: 16,
                max_episode_tokens: 4096,
                observation_char_cap: 500,
            }),
            sampling: Some(sleuth_proto::common::v1::SamplingParams { seed: Some(5), ..Default::default() }),
            ..Default::default()
        }),
        group_size: 2,
        global_batch_size: 2,
        max_epochs: 1,
        rollout_max_concurrency: 4,
        max_staleness: 1,
        policy: Some(rollout::PolicySpec { from_run: "no-such-run".into(), ..Default::default() }),
        training: Some(rollout::TrainingSpec { learning_rate: 1e-3, checkpoint_every: 1, ..Default::default() }),
        ..Default::default()
    };
    let create =
        |spec: &rollout::RunSpec| rollout::CreateRunRequest { spec: Some(spec.clone()), run_id: "grpo".into() };
    let refused = client.create_run(create(&grpo)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("spec.policy.from_run \"no-such-run\""), "{}", refused.message());
    grpo.policy = Some(rollout::PolicySpec { from_run: RUN.into(), ..Default::default() });
    client.create_run(create(&grpo)).await?;
    let mut grpo_learner = mesh.learner("grpo", scratch.path(), &scratch.path().join("runs.db"), &orchestrator)?;
    let ended = wait_for(&mut client, "grpo", std::time::Duration::from_secs(300), |run| {
        run.status != rollout::RunStatus::Running as i32
    })
    .await?;
    assert_eq!(ended.status, rollout::RunStatus::Succeeded as i32, "{}", ended.status_detail);
    let (exit, _) = grpo_learner.wait(std::time::Duration::from_secs(120))?;
    assert!(exit.success(), "learner exited with {exit}; log:\n{}", grpo_learner.log());
    let sft_checkpoints = scratch.path().join("checkpoints").join(RUN);
    // GRPO continues where SFT ended (its newest complete checkpoint), whichever version validated best.
    let sft_store = sleuth_store::ObjectStore::Local { root: sft_checkpoints.clone() };
    let newest = *learner::checkpoint::complete_steps(&sft_store).await?.last().context("a complete SFT checkpoint")?;
    let validated = finished.validations.iter().map(|v| v.version).max().context("validated")?;
    assert_eq!(newest, validated, "SFT's last version is validated and has its checkpoint");
    let expected = sft_checkpoints.join(learner::checkpoint::step_dir(newest)).join("hf");
    let grpo_steps = learner::records::steps(&database, "grpo").await?;
    let start = grpo_steps.iter().find(|(_, m)| m["republished"] == "start model").context("a start-model step")?;
    assert_eq!(start.1["model_uri"], expected.display().to_string(), "{grpo_steps:?}");
    eprintln!("grpo from run {RUN}: started from {} as version {}", expected.display(), start.0);

    the_dashboard_shows_the_runs(&orchestrator, &database, &entries, steps.len()).await
}

/// The orchestrator's dashboard as a real browser renders it, on the runs
/// above: the SFT run's page draws one point per learner step on each
/// learner curve and marks the best version; a trained episode's page marks
/// exactly its trained tokens, spelled by the policy's tokenizer; a GRPO
/// episode names its advantage; the evaluations sit side by side with
/// intervals. Screenshots go to `$CARGO_TARGET_TMPDIR/dashboard/`.
async fn the_dashboard_shows_the_runs(
    orchestrator: &sleuth_tests::ServiceProcess,
    database: &sleuth_store::Database,
    entries: &BTreeMap<String, sleuth_proto::common::v1::TrajectoryGroup>,
    steps: usize,
) -> Result<()> {
    let base = format!("http://{}", orchestrator.http.as_deref().context("the orchestrator's dashboard")?);
    let browser = Browser::find()?;
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard");
    std::fs::create_dir_all(&out)?;

    let runs = browser.dom(&format!("{base}/")).await?;
    assert!(runs.contains("href=\"/runs/sft\"") && runs.contains("href=\"/runs/grpo\""), "{runs}");

    let run = browser.dom(&format!("{base}/runs/sft")).await?;
    for metric in ["loss", "entropy", "grad_norm", "tokens_per_second"] {
        assert_eq!(curve(&run, metric)?, steps, "{metric}: one point per learner step");
    }
    assert!(curve(&run, "ndcg")? >= 2, "the validations are drawn");
    assert!(run.contains("class=\"mark\"") && run.contains("★ best"), "the best checkpoint is marked");
    browser.screenshot(&format!("{base}/runs/sft"), &out.join("run.png"), (1400, 2400)).await?;

    // An episode the learner trained on: every trained token marked, no other.
    let (episode_id,): (String,) = sqlx::query_as(
        "SELECT e.episode_id FROM run_episodes e JOIN learner_groups g ON g.run_id = e.run_id AND g.group_id = e.group_id
         WHERE e.run_id = 'sft' AND g.disposition = 'trained' ORDER BY e.reward DESC, e.episode_id LIMIT 1",
    )
    .fetch_one(database.pool())
    .await?;
    let episode =
        entries.values().flat_map(|g| &g.episodes).find(|e| e.episode_id == episode_id).context("published")?;
    let segments = &episode.trace.as_ref().context("a trace")?.segments;
    let trained = segments.iter().flat_map(|s| s.loss_mask.iter()).filter(|&&m| m == 1).count();
    let url = format!("{base}/runs/sft/episodes/{episode_id}");
    let page = browser.dom(&url).await?;
    assert!(trained > 0);
    assert_eq!(page.matches("class=\"tok trained\"").count(), trained, "trained tokens marked");
    let tokens: usize = segments.iter().map(|s| s.token_ids.len()).sum();
    assert_eq!(page.matches("<span class=\"tok ").count(), tokens + 1, "every token shown (and the legend)");
    assert!(page.contains("Trained in step") && page.contains("Trajectory SFT"), "{page}");
    assert!(!page.contains("show as ids"), "the tokens are spelled out");
    assert!(
        page.contains("submit_ranking") && page.contains("class=\"judged\""),
        "the tool calls and the judged documents"
    );
    browser.screenshot(&url, &out.join("episode.png"), (1400, 2400)).await?;

    let (grpo_episode,): (String,) =
        sqlx::query_as("SELECT episode_id FROM run_episodes WHERE run_id = 'grpo' ORDER BY episode_id LIMIT 1")
            .fetch_one(database.pool())
            .await?;
    let page = browser.dom(&format!("{base}/runs/grpo/episodes/{grpo_episode}")).await?;
    assert!(page.contains("Advantage (grpo)") || page.contains("rewards do not differ"), "{page}");

    let evaluations = browser.dom(&format!("{base}/evaluations")).await?;
    assert!(evaluations.contains("validation of") && evaluations.contains(" ["), "{evaluations}");
    browser.screenshot(&format!("{base}/evaluations"), &out.join("evaluations.png"), (1400, 900)).await?;
    eprintln!("dashboard: {steps} steps drawn, {trained} trained tokens marked; screenshots in {}", out.display());
    Ok(())
}

/// The points of the chart of `metric` in a rendered run page: the count
/// it declares, checked against the vertices of its lines.
fn curve(dom: &str, metric: &str) -> Result<usize> {
    let start = dom.find(&format!("data-metric=\"{metric}\"")).with_context(|| format!("no {metric} chart"))?;
    let figure = &dom[start..start + dom[start..].find("</figure>").context("an unclosed figure")?];
    let declared: usize =
        figure.split("data-points=\"").nth(1).and_then(|s| s.split('"').next()).context("data-points")?.parse()?;
    let vertices: usize =
        figure.split(" points=\"").skip(1).map(|s| s.split('"').next().unwrap_or("").split_whitespace().count()).sum();
    anyhow::ensure!(vertices == declared, "{metric}: {vertices} vertices drawn, {declared} declared");
    Ok(declared)
}
