//! Evaluations side by side: every report the orchestrator's jobs wrote
//! (baselines, validations of runs, evaluations of served policies), with
//! nDCG@10 and its 95 % bootstrap interval over tasks, failure rate, turns
//! and tokens; with `?against=<id>`, each one's paired difference to that
//! evaluation on the tasks both scored, as `sleuth` reports compare systems.

use std::fmt::Write as _;

use axum::extract::{Query, State};
use axum::response::Html;
use sleuth_metrics::bootstrap::{Interval, mean_interval, paired_interval};
use sleuth_metrics::reward::failure_rate;

use super::html::{escape, number, page, pager, segment};
use super::records;
use super::{Dashboard, PageError};

/// One seed for every interval, so a page shows the same figures each time.
const SEED: u64 = 20_261_202;

/// Reports a page lists.
const PAGE: usize = 50;

#[derive(serde::Deserialize)]
pub struct ListQuery {
    /// The evaluation the others are compared with.
    against: Option<String>,
    page: Option<u64>,
}

fn shown(interval: Option<Interval>) -> String {
    interval.map_or_else(|| "-".to_owned(), |i| format!("{:.3} [{:.3}, {:.3}]", i.mean, i.low, i.high))
}

/// `GET /evaluations`.
pub async fn list(
    State(dashboard): State<Dashboard>,
    Query(query): Query<ListQuery>,
) -> Result<Html<String>, PageError> {
    let files = records::report_files(&dashboard.report_dir);
    let owners = records::validation_owners(&dashboard.database).await?;
    let reference = match &query.against {
        Some(id) => {
            let not_found = || PageError::NotFound(format!("against: no evaluation {id:?}"));
            sleuth_kit::names::check_name("against", id).map_err(|_| not_found())?;
            let path = dashboard.report_dir.join(format!("{id}.json"));
            let written = files.iter().find(|(p, _)| *p == path).map(|(_, w)| *w).ok_or_else(not_found)?;
            Some((records::read_report(&path).map_err(|_| not_found())?, (path, written)))
        }
        None => None,
    };
    let page_no = query.page.unwrap_or(0);
    let mut body = format!(
        "<h1>Evaluations</h1><p>{} reports in <code>{}</code>, newest first. nDCG@10 with its 95 % bootstrap \
         interval over tasks; choose a row's <i>compare</i> for paired differences against it.</p>",
        files.len(),
        escape(&dashboard.report_dir.display().to_string())
    );
    if let Some((reference, _)) = &reference {
        let _ = write!(body, "<p>Δ against <b>{}</b>, paired by task.</p>", escape(&reference.evaluation_id));
    }
    body.push_str(
        "<table><tr><th>evaluation</th><th>what</th><th>tasks</th><th>nDCG@10 [95 %]</th><th>Δ nDCG@10 [95 %]</th>\
         <th>failures</th><th>turns</th><th>tokens</th><th></th></tr>",
    );
    let mut problems = Vec::new();
    for file in files.iter().skip(page_no as usize * PAGE).take(PAGE) {
        let report = match records::read_report(&file.0) {
            Ok(report) => report,
            Err(error) => {
                problems.push(format!("{}: {error}", file.0.display()));
                continue;
            }
        };
        let what = match owners.get(&report.evaluation_id) {
            Some((run, version)) => {
                format!("validation of <a href=\"/runs/{}\">{}</a> at version {version}", segment(run), escape(run))
            }
            None => escape(&report.contender),
        };
        let scores: Vec<f64> = report.per_task.values().copied().collect();
        let mean = dashboard.interval(file, None, || mean_interval(&scores, SEED).map(|i| (i, scores.len())));
        let delta = match &reference {
            Some((r, _)) if r.evaluation_id == report.evaluation_id => "reference".to_owned(),
            Some((r, against)) => {
                let paired = dashboard.interval(file, Some(against), || {
                    paired_interval(report.per_task.iter().map(|(t, s)| (t.as_str(), *s)), &r.per_task, SEED)
                });
                match paired {
                    Some((i, tasks)) => format!(
                        "<span class={}>{:+.3} [{:+.3}, {:+.3}]</span> on {tasks}",
                        i.verdict("good", "bad"),
                        i.mean,
                        i.low,
                        i.high
                    ),
                    None => "-".to_owned(),
                }
            }
            None => "-".to_owned(),
        };
        let failures = failure_rate(&report.metrics);
        let _ = write!(
            body,
            "<tr><td>{}</td><td>{what} · {}/{}</td><td class=n>{}</td><td class=n>{}</td><td class=n>{delta}</td>\
             <td class=n>{}</td><td class=n>{}</td><td class=n>{}</td><td><a href=\"/evaluations?against={}\">compare</a></td></tr>",
            escape(&report.evaluation_id),
            escape(&report.collection),
            escape(&report.split),
            report.tasks,
            if scores.is_empty() {
                number(report.metrics.get("ndcg@10").copied())
            } else {
                shown(mean.map(|(i, _)| i))
            },
            number(Some(failures)),
            number(report.metrics.get("turns").copied()),
            number(report.metrics.get("tokens").copied()),
            segment(&report.evaluation_id),
        );
    }
    body.push_str("</table>");
    let against = query.against.as_deref().map_or_else(String::new, |id| format!("against={}&", segment(id)));
    body.push_str(&pager(page_no, (page_no as usize + 1) * PAGE < files.len(), |n| {
        format!("/evaluations?{against}page={n}")
    }));
    for problem in &problems {
        let _ = write!(body, "<p class=bad>not a report: {}</p>", escape(problem));
    }
    Ok(page("Evaluations", &body))
}
