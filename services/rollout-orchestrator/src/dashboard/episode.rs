//! An episode's page: the task, how it ended and its reward; what the
//! learner did with its group and the advantage it trained it with; the
//! submitted ranking with the judged documents marked, or the answer in
//! words beside the reference answers with each citation marked; every turn's
//! messages and tool calls with their observations; and the token view of
//! its trace, trained tokens marked, each token's logprob and policy version
//! on hover.

use std::fmt::Write as _;

use axum::extract::{Path, State};
use axum::response::Html;
use sleuth_metrics::advantage::{Estimator, advantages};
use sleuth_metrics::reward::outcome_name;
use sleuth_proto::common::v1::{Episode, SegmentKind, Task, TrajectoryGroup};
use sleuth_proto::rollout::v1::RunSpec;

use super::html::{escape, number, page, segment};
use super::records::{self, Taken};
use super::{Dashboard, PageError};

/// `GET /runs/{run}/episodes/{episode}`.
pub async fn show(
    State(dashboard): State<Dashboard>,
    Path((run_id, episode_id)): Path<(String, String)>,
) -> Result<Html<String>, PageError> {
    let state = &dashboard.runner.state;
    let run = state.run(&run_id).await?.ok_or_else(|| PageError::NotFound(format!("no run {run_id:?}")))?;
    let group_id = records::group_of(&dashboard.database, &run_id, &episode_id)
        .await?
        .ok_or_else(|| PageError::NotFound(format!("run {run_id:?} has no episode {episode_id:?}")))?;
    let title = format!("Episode {episode_id}");
    let mut body = format!(
        "<p><a href=\"/runs/{}\">&larr; run {}</a></p><h1>{}</h1>",
        segment(&run_id),
        escape(&run_id),
        escape(&title)
    );
    let group = state.group_trajectories(&run_id, &group_id).await?;
    let Some((group, episode)) =
        group.and_then(|g| g.episodes.iter().position(|e| e.episode_id == episode_id).map(|i| (g.clone(), i)))
    else {
        let _ = write!(
            body,
            "<p>Group {} is not published yet, or was recorded before the orchestrator kept trajectories: \
             its turns cannot be shown.</p>",
            escape(&group_id)
        );
        return Ok(page(&title, &body));
    };
    let spec = run.spec.unwrap_or_default();
    let task = group.task.clone().unwrap_or_default();
    let taken = records::taken(&dashboard.database, &run_id, &group_id).await?;
    summary(&mut body, &group, episode, &task);
    learning(&mut body, &spec, &group, episode, taken.as_ref());
    let this = &group.episodes[episode];
    // An answer task shows its answer; a ranking task, or an answer task's
    // episode that ranked instead, its ranking.
    if !this.answer.is_empty() || !task.answers.is_empty() {
        answer(&mut body, this, &task);
    }
    if !this.ranking.is_empty() || task.answers.is_empty() {
        ranking(&mut body, this, &task);
    }
    messages(&mut body, this);
    tokens(&mut body, this, dashboard.tokenizer(&spec).as_deref());
    Ok(page(&title, &body))
}

fn summary(body: &mut String, group: &TrajectoryGroup, index: usize, task: &Task) {
    let e = &group.episodes[index];
    let _ = write!(
        body,
        "<p><b>Question</b> ({}): {}</p><table><tr><th>outcome</th><td>{}{}</td></tr><tr><th>reward</th><td>{}</td></tr>",
        escape(&task.task_id),
        escape(&task.question),
        outcome_name(e.outcome()),
        if e.outcome_detail.is_empty() { String::new() } else { format!(": {}", escape(&e.outcome_detail)) },
        number(Some(e.reward))
    );
    for (name, value) in &e.metrics {
        let _ = write!(body, "<tr><th>{}</th><td>{}</td></tr>", escape(name), number(Some(*value)));
    }
    let _ = write!(
        body,
        "<tr><th>turns</th><td>{}</td></tr><tr><th>tokens</th><td>{} ({} generated)</td></tr>\
         <tr><th>policy versions</th><td>{}–{}</td></tr><tr><th>group</th><td>{} (sample {} of {}, epoch {}, started at version {})</td></tr>\
         <tr><th>trace id</th><td><code>{}</code></td></tr></table>",
        e.turns,
        e.total_tokens,
        e.generated_tokens,
        e.min_policy_version,
        e.max_policy_version,
        escape(&group.group_id),
        e.sample_index,
        group.episodes.len(),
        group.epoch,
        group.policy_version,
        escape(&e.trace_id)
    );
}

/// What the learner made of the episode: trained in which step, with which
/// advantage (the shared estimator over the group's rewards, as the learner
/// computes it), or dropped and why.
fn learning(body: &mut String, spec: &RunSpec, group: &TrajectoryGroup, index: usize, taken: Option<&Taken>) {
    body.push_str("<h2>Learner</h2><p>");
    match taken {
        None => body.push_str(
            "Not taken by the learner yet (or the learner records to another database than the orchestrator).",
        ),
        Some(t) if t.disposition == "trained" => {
            let _ = write!(body, "Trained in step {}. ", t.step);
        }
        Some(t) => {
            let _ =
                write!(body, "Not trained: {} in step {} ({}). ", escape(&t.disposition), t.step, escape(&t.detail));
        }
    }
    let training = spec.training.clone().unwrap_or_default();
    let teacher = spec.agent.as_ref().is_some_and(|a| !a.teacher.is_empty());
    if teacher {
        let _ = write!(
            body,
            "Trajectory SFT: the episode is a demonstration, trained on without an advantage when its reward reaches {}.",
            training.sft_min_reward
        );
    } else {
        let name = if training.advantage.is_empty() { "grpo" } else { training.advantage.as_str() };
        let rewards: Vec<f64> = group.episodes.iter().map(|e| e.reward).collect();
        match name.parse::<Estimator>().ok().and_then(|estimator| advantages(estimator, &rewards)) {
            Some(values) => {
                let _ = write!(
                    body,
                    "Advantage ({}) over the group's rewards: <b>{:+.4}</b>.",
                    escape(name),
                    values[index]
                );
            }
            None => {
                let _ = write!(body, "No advantage ({}): the group's rewards do not differ.", escape(name));
            }
        }
    }
    body.push_str("</p>");
}

fn ranking(body: &mut String, episode: &Episode, task: &Task) {
    let _ = write!(body, "<h2>Submitted ranking ({})</h2>", episode.ranking.len());
    if episode.ranking.is_empty() {
        body.push_str("<p>nothing submitted</p>");
    } else {
        body.push_str("<ol>");
        for doc in &episode.ranking {
            match task.qrels.get(doc).copied().unwrap_or(0) {
                grade if grade > 0 => {
                    let _ = write!(
                        body,
                        "<li class=judged title=\"judged relevant: {grade}\">{} (relevance {grade})</li>",
                        escape(doc)
                    );
                }
                _ => {
                    let _ = write!(body, "<li>{}</li>", escape(doc));
                }
            }
        }
        body.push_str("</ol>");
    }
    missed(body, task, &episode.ranking, "submitted");
}

/// The task's relevant documents not among `listed`, with their grades.
fn missed(body: &mut String, task: &Task, listed: &[String], verb: &str) {
    let mut missed: Vec<String> = task
        .qrels
        .iter()
        .filter(|&(doc, &grade)| grade > 0 && !listed.contains(doc))
        .map(|(doc, grade)| format!("{} ({grade})", escape(doc)))
        .collect();
    missed.sort();
    if !missed.is_empty() {
        let _ = write!(body, "<p>Judged relevant, not {verb}: {}</p>", missed.join(", "));
    }
}

/// The answer beside the references, and each citation: judged relevant
/// (and its grade), not relevant, or never shown by a tool (which never
/// counts, docs/rewards.md); then the relevant documents it did not cite.
fn answer(body: &mut String, episode: &Episode, task: &Task) {
    let answered = if episode.answer.is_empty() { "<i>no answer</i>".to_owned() } else { escape(&episode.answer) };
    let references: Vec<String> = task.answers.iter().map(|a| escape(a)).collect();
    let _ = write!(
        body,
        "<h2>Answer</h2><table><tr><th>answer</th><td class=answer>{answered}</td></tr>         <tr><th>reference</th><td class=reference>{}</td></tr></table>",
        if references.is_empty() { "<i>none</i>".to_owned() } else { references.join(" · ") }
    );
    let _ = write!(body, "<h3>Citations ({})</h3>", episode.citations.len());
    if !episode.citations.is_empty() {
        body.push_str("<ol>");
        for doc in &episode.citations {
            let grade = task.qrels.get(doc).copied().unwrap_or(0);
            let (class, note) = match (episode.shown_doc_ids.contains(doc), grade) {
                (false, _) => ("unseen", "never shown by a tool: does not count".to_owned()),
                (true, grade) if grade > 0 => ("judged", format!("relevance {grade}")),
                (true, _) => ("cited", "not judged relevant".to_owned()),
            };
            let _ = write!(body, "<li class={class}>{} ({note})</li>", escape(doc));
        }
        body.push_str("</ol>");
    }
    missed(body, task, &episode.citations, "cited");
}

fn messages(body: &mut String, episode: &Episode) {
    body.push_str("<h2>Conversation</h2>");
    for message in &episode.messages {
        let _ = write!(body, "<div class=msg><div class=role>{}", escape(&message.role));
        if !message.name.is_empty() {
            let _ = write!(body, " · {}", escape(&message.name));
        }
        if !message.tool_call_id.is_empty() {
            let _ = write!(body, " · answers {}", escape(&message.tool_call_id));
        }
        body.push_str("</div>");
        if !message.content.is_empty() {
            let _ = write!(body, "<pre>{}</pre>", escape(&message.content));
        }
        for call in &message.tool_calls {
            let arguments = serde_json::from_str::<serde_json::Value>(&call.arguments_json)
                .ok()
                .and_then(|v| serde_json::to_string_pretty(&v).ok())
                .unwrap_or_else(|| call.arguments_json.clone());
            let _ = write!(
                body,
                "<div>tool call <b>{}</b> ({})<pre>{}</pre></div>",
                escape(&call.name),
                escape(&call.id),
                escape(&arguments)
            );
        }
        body.push_str("</div>");
    }
}

fn tokens(body: &mut String, episode: &Episode, tokenizer: Option<&tokenizers::Tokenizer>) {
    let Some(trace) = &episode.trace else {
        body.push_str("<h2>Tokens</h2><p>no trace recorded</p>");
        return;
    };
    let count: usize = trace.segments.iter().map(|s| s.token_ids.len()).sum();
    let trained: usize = trace.segments.iter().flat_map(|s| s.loss_mask.iter()).filter(|&&m| m == 1).count();
    let _ = write!(
        body,
        "<h2>Tokens</h2><p>{count} tokens, <span class=\"tok trained legend\">{trained} trained</span> (sampled by the policy); \
         prompt and template glue in grey, tool observations shaded. Hover a token for its id, logprob and policy version.{}</p><div class=tokens>",
        if tokenizer.is_some() { "" } else { " No tokenizer for this run's model (SLEUTH_MODEL): tokens show as ids." }
    );
    for segment in &trace.segments {
        let kind = match segment.kind() {
            SegmentKind::Policy => "policy",
            SegmentKind::Observation => "observation",
            _ => "prompt",
        };
        for (i, &id) in segment.token_ids.iter().enumerate() {
            let trained = segment.loss_mask.get(i) == Some(&1);
            let text = match tokenizer.map(|t| t.decode(&[id], false)) {
                Some(Ok(text)) => text,
                _ => format!("[{id}]"),
            };
            let logprob = segment.logprobs.get(i).map_or_else(String::new, |l| format!(" · logprob {l:.4}"));
            let _ = write!(
                body,
                "<span class=\"tok {}\" title=\"id {id}{logprob} · version {} · turn {} · {kind}\">{}</span>",
                if trained { "trained" } else { kind },
                segment.policy_version,
                segment.turn,
                escape(&text)
            );
        }
    }
    body.push_str("</div>");
}
