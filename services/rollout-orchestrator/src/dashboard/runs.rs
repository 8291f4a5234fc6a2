//! The runs list and a run's page: status, progress and spec; the curves
//! against step (training from the episodes and the learner's records,
//! validation, failures by outcome, staleness), the best checkpoint marked;
//! the validations; and the run's episodes, a page at a time.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use axum::extract::{Path, Query, State};
use axum::response::Html;
use sleuth_metrics::reward::{failure_rate, outcome_name};
use sleuth_proto::common::v1::EpisodeOutcome;
use sleuth_proto::rollout::v1::{Run, RunStatus};

use super::chart::{Chart, Series};
use super::html::{escape, number, page, pager, segment};
use super::records;
use super::{Dashboard, PageError, Paging};
use crate::state::OutcomeCount;

/// Runs and episodes per page.
pub const PAGE: u64 = 50;

fn status(run: &Run) -> &'static str {
    RunStatus::try_from(run.status).map_or("unknown", |s| s.as_str_name().trim_start_matches("RUN_STATUS_"))
}

fn time(at: Option<&prost_types::Timestamp>) -> String {
    at.map_or_else(String::new, |t| {
        humantime::format_rfc3339_seconds(
            std::time::UNIX_EPOCH + std::time::Duration::from_secs(t.seconds.max(0) as u64),
        )
        .to_string()
    })
}

/// `GET /`: every run, newest first.
pub async fn list(State(dashboard): State<Dashboard>, Query(paging): Query<Paging>) -> Result<Html<String>, PageError> {
    let page_no = paging.page.unwrap_or(0);
    let mut runs = dashboard.runner.state.runs((page_no * PAGE) as i64, PAGE as i64 + 1).await?;
    let mut body = String::from(
        "<h1>Runs</h1><table><tr><th>run</th><th>name</th><th>status</th><th>groups</th><th>episodes</th>\
         <th>learner version</th><th>created</th><th>updated</th><th>detail</th></tr>",
    );
    for run in runs.iter_mut().take(PAGE as usize) {
        dashboard.runner.add_activity(run);
        let progress = run.progress;
        let cell =
            |f: fn(&sleuth_proto::rollout::v1::RunProgress) -> String| progress.as_ref().map_or_else(String::new, f);
        let _ = write!(
            body,
            "<tr><td><a href=\"/runs/{}\">{}</a></td><td>{}</td><td>{}</td><td class=n>{}</td><td class=n>{}</td>\
             <td class=n>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            segment(&run.run_id),
            escape(&run.run_id),
            escape(run.spec.as_ref().map_or("", |s| s.name.as_str())),
            status(run),
            cell(|p| format!("{}/{}", p.groups_published, p.groups_total)),
            cell(|p| p.episodes_finished.to_string()),
            cell(|p| p.policy_version.to_string()),
            time(run.created_at.as_ref()),
            time(run.updated_at.as_ref()),
            escape(&run.status_detail),
        );
    }
    body.push_str("</table>");
    body.push_str(&pager(page_no, runs.len() as u64 > PAGE, |n| format!("/?page={n}")));
    Ok(page("Runs", &body))
}

/// Per-version series from the (version, outcome) counts: every curve the
/// training episodes give.
struct EpisodeCurves {
    reward: Series,
    ndcg: Series,
    turns: Series,
    tokens: Series,
    /// Share of each version's episodes per failing outcome.
    failures: Vec<Series>,
    total: u64,
}

fn episode_curves(counts: &[OutcomeCount]) -> EpisodeCurves {
    let mut per_version: BTreeMap<u64, Vec<&OutcomeCount>> = BTreeMap::new();
    for count in counts {
        per_version.entry(count.version).or_default().push(count);
    }
    let series = |name: &str, f: &dyn Fn(&[&OutcomeCount], f64) -> f64| Series {
        name: name.to_owned(),
        points: per_version
            .iter()
            .map(|(&v, c)| {
                let n = c.iter().map(|c| c.episodes).sum::<u64>().max(1) as f64;
                (v as f64, f(c, n))
            })
            .collect(),
    };
    let failing: std::collections::BTreeSet<i32> =
        counts.iter().map(|c| c.outcome).filter(|&o| o != EpisodeOutcome::Completed as i32).collect();
    EpisodeCurves {
        reward: series("training reward", &|c, n| c.iter().map(|c| c.reward_sum).sum::<f64>() / n),
        ndcg: series("training nDCG@10", &|c, n| c.iter().map(|c| c.ndcg_sum).sum::<f64>() / n),
        turns: series("mean turns", &|c, n| c.iter().map(|c| c.turns_sum).sum::<f64>() / n),
        tokens: series("mean tokens", &|c, n| c.iter().map(|c| c.tokens_sum).sum::<f64>() / n),
        failures: failing
            .into_iter()
            .map(|outcome| {
                let name = outcome_name(EpisodeOutcome::try_from(outcome).unwrap_or_default());
                series(name, &|c, n| {
                    c.iter().filter(|c| c.outcome == outcome).map(|c| c.episodes).sum::<u64>() as f64 / n
                })
            })
            .collect(),
        total: counts.iter().map(|c| c.episodes).sum(),
    }
}

/// The learner's step metrics the run page draws: (field of `StepStats`, title).
const STEP_CURVES: [(&str, &str); 7] = [
    ("loss", "Loss"),
    ("kl", "KL to the reference"),
    ("entropy", "Entropy"),
    ("clip_fraction", "Clip fraction"),
    ("logprob_mismatch", "Train/inference mismatch (mean |Δ logprob|)"),
    ("grad_norm", "Gradient norm"),
    ("tokens_per_second", "Learner tokens/s"),
];

/// `GET /runs/{run}`.
pub async fn show(
    State(dashboard): State<Dashboard>,
    Path(run_id): Path<String>,
    Query(paging): Query<Paging>,
) -> Result<Html<String>, PageError> {
    let state = &dashboard.runner.state;
    let mut run = state.run(&run_id).await?.ok_or_else(|| PageError::NotFound(format!("no run {run_id:?}")))?;
    dashboard.runner.add_activity(&mut run);
    let validations = state.validations(&run_id).await?;
    let best = crate::validate::best(&validations);
    let (counts, steps, staleness) = (
        state.outcomes(&run_id).await?,
        dashboard.database.learner_steps(&run_id).await?,
        records::staleness(&dashboard.database, &run_id).await?,
    );
    let curves = episode_curves(&counts);
    let mark = best.map(|v| (v as f64, "best"));
    let validation_score = Series {
        name: "validation score".to_owned(),
        points: validations
            .iter()
            .filter_map(|v| sleuth_metrics::validation::score(v).map(|m| (v.version as f64, m)))
            .collect(),
    };
    let validation_failures = Series {
        name: "validation failures".into(),
        points: validations
            .iter()
            .map(|v| {
                let failed = failure_rate(&v.metrics);
                (v.version as f64, failed)
            })
            .collect(),
    };
    let mut charts = vec![
        Chart { metric: "reward", title: "Training reward", series: vec![curves.reward], mark },
        Chart {
            metric: "ndcg",
            title: "Validation score (the reward's headline metric) and training nDCG@10",
            series: vec![validation_score, curves.ndcg],
            mark,
        },
        Chart {
            metric: "failures",
            title: "Failure rate by outcome",
            series: curves.failures.into_iter().chain([validation_failures]).collect(),
            mark,
        },
        Chart { metric: "turns", title: "Mean turns", series: vec![curves.turns], mark },
        Chart { metric: "tokens", title: "Mean tokens per episode", series: vec![curves.tokens], mark },
    ];
    for (field, title) in STEP_CURVES {
        let points = steps.iter().filter_map(|(s, m)| m[field].as_f64().map(|v| (*s as f64, v))).collect();
        charts.push(Chart { metric: field, title, series: vec![Series { name: field.to_owned(), points }], mark });
    }
    charts.push(Chart {
        metric: "staleness",
        title: "Staleness of trained groups (versions)",
        series: vec![
            Series { name: "mean".into(), points: staleness.iter().map(|&(s, mean, _)| (s as f64, mean)).collect() },
            Series { name: "max".into(), points: staleness.iter().map(|&(s, _, most)| (s as f64, most)).collect() },
        ],
        mark,
    });

    let mut body = format!("<h1>Run {}</h1><p>status <b>{}</b>", escape(&run_id), status(&run));
    if !run.status_detail.is_empty() {
        let _ = write!(body, " ({})", escape(&run.status_detail));
    }
    if let Some(progress) = &run.progress {
        let _ = write!(
            body,
            " · epoch {} · groups {}/{} · episodes {} ({} in flight) · learner version {}",
            progress.epoch,
            progress.groups_published,
            progress.groups_total,
            progress.episodes_finished,
            progress.episodes_in_flight,
            progress.policy_version
        );
    }
    let _ = write!(
        body,
        " · {} training episodes · {} learner steps recorded · best checkpoint by validation score: {}</p>",
        curves.total,
        steps.len(),
        best.map_or_else(|| "none yet".to_owned(), |v| format!("version {v}"))
    );
    body.push_str("<div class=charts>");
    for chart in &charts {
        body.push_str(&chart.render());
    }
    body.push_str("</div>");
    validations_table(&mut body, &validations, best);
    episodes_table(&dashboard, &mut body, &run_id, paging.page.unwrap_or(0), curves.total).await?;
    let _ =
        write!(body, "<details><summary>Spec</summary><pre>{}</pre></details>", escape(&format!("{:#?}", run.spec)));
    Ok(page(&format!("Run {run_id}"), &body))
}

fn validations_table(body: &mut String, validations: &[sleuth_proto::rollout::v1::Validation], best: Option<u64>) {
    body.push_str("<h2>Validations</h2>");
    if validations.is_empty() {
        body.push_str("<p>none (spec.validation and training.eval_every)</p>");
        return;
    }
    body.push_str(
        "<table><tr><th>version</th><th>score</th><th>reward</th><th>failures</th><th>turns</th><th>tokens</th><th>evaluation</th></tr>",
    );
    for v in validations {
        let metric = |name: &str| number(v.metrics.get(name).copied());
        let failures = failure_rate(&v.metrics);
        let _ = write!(
            body,
            "<tr><td class=n>{}{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td>{}</td></tr>",
            v.version,
            if Some(v.version) == best { " ★ best" } else { "" },
            number(sleuth_metrics::validation::score(v)),
            metric("reward"),
            number(Some(failures)),
            metric("turns"),
            metric("tokens"),
            escape(&v.evaluation_id)
        );
    }
    body.push_str("</table>");
}

async fn episodes_table(
    dashboard: &Dashboard,
    body: &mut String,
    run_id: &str,
    page_no: u64,
    total: u64,
) -> Result<(), PageError> {
    let episodes = dashboard.runner.state.episodes(run_id, page_no * PAGE, PAGE).await?;
    let _ = write!(
        body,
        "<h2 id=episodes>Episodes ({total})</h2><table><tr><th>episode</th><th>task</th><th>outcome</th><th>reward</th>\
         <th>nDCG@10</th><th>turns</th><th>tokens</th><th>version</th><th>trace</th></tr>"
    );
    for e in &episodes {
        let _ = write!(
            body,
            "<tr><td><a href=\"/runs/{}/episodes/{}\">{}</a></td><td>{}</td><td>{}</td><td class=n>{}</td><td class=n>{}</td>\
             <td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td><code>{}</code></td></tr>",
            segment(run_id),
            segment(&e.episode_id),
            escape(&e.episode_id),
            escape(&e.task_id),
            outcome_name(e.outcome()),
            number(Some(e.reward)),
            number(e.metrics.get("ndcg@10").copied()),
            e.turns,
            e.total_tokens,
            e.policy_version,
            escape(&e.trace_id)
        );
    }
    body.push_str("</table>");
    let run = segment(run_id);
    body.push_str(&pager(page_no, (page_no + 1) * PAGE < total, |n| format!("/runs/{run}?page={n}#episodes")));
    Ok(())
}
