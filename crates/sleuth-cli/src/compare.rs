//! `sleuth compare`: finished evaluations side by side, each with one
//! metric (`--metric`: nDCG@10 by default; any metric the evaluations
//! recorded per task, such as `answer_f1` or `citation_precision`) and its
//! 95 % bootstrap interval over tasks, and its paired difference to one
//! reference evaluation on the tasks both scored (resampling tasks, so task
//! difficulty cancels); failure rate, turns and tokens beside them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use sleuth_metrics::bootstrap::{Interval, mean_interval, paired_interval};
use sleuth_metrics::reward::failure_rate;
use sleuth_proto::rollout::v1 as pb;

use crate::runs::{Endpoint, client};

/// One seed for every interval, so a table prints the same figures each time.
const SEED: u64 = 20_261_202;

#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    #[command(flatten)]
    endpoint: Endpoint,
    /// The row the others are compared with, by its label.
    #[arg(long)]
    against: String,
    /// The metric compared, as the evaluations record it per task
    /// (`ndcg@10`, `score`, `answer_f1`, `answer_em`, `citation_precision`,
    /// `citation_recall`, `citation_f1`, `reward`, ...).
    #[arg(long, default_value = "ndcg@10")]
    metric: String,
    /// Evaluations to list, in order, as LABEL=EVALUATION_ID (`sleuth eval` prints the id).
    #[arg(required = true)]
    rows: Vec<String>,
}

/// A row: its label and the finished evaluation.
struct Row {
    label: String,
    evaluation: pb::Evaluation,
}

/// `sleuth compare`: prints the table; an unfinished or unknown evaluation is an error.
pub async fn run(args: CompareArgs) -> anyhow::Result<()> {
    let mut orchestrator = client(&args.endpoint).await?;
    let mut rows = Vec::new();
    for row in &args.rows {
        let (label, id) =
            row.split_once('=').ok_or_else(|| anyhow::anyhow!("row {row:?} is not LABEL=EVALUATION_ID"))?;
        let evaluation = orchestrator
            .get_evaluation(pb::GetEvaluationRequest { evaluation_id: id.to_owned() })
            .await
            .map_err(|s| anyhow::anyhow!("row {label}: {}", s.message()))?
            .into_inner();
        anyhow::ensure!(
            evaluation.status == pb::RunStatus::Succeeded as i32,
            "row {label}: evaluation {id} has not succeeded (status {}) {}",
            evaluation.status,
            evaluation.status_detail
        );
        rows.push(Row { label: label.to_owned(), evaluation });
    }
    print!("{}", table(&rows, &args.against, &args.metric)?);
    Ok(())
}

/// Each task's `metric` in `row`; an error when the row recorded none.
fn per_task(row: &Row, metric: &str) -> anyhow::Result<BTreeMap<String, f64>> {
    let scores: BTreeMap<String, f64> = row
        .evaluation
        .per_task
        .iter()
        .filter_map(|(task, scores)| scores.metrics.get(metric).map(|score| (task.clone(), *score)))
        .collect();
    if scores.is_empty() {
        let recorded: std::collections::BTreeSet<&String> =
            row.evaluation.per_task.values().flat_map(|t| t.metrics.keys()).collect();
        anyhow::bail!("--metric {metric:?}: row {} recorded no such metric per task (it has {recorded:?})", row.label);
    }
    Ok(scores)
}

fn table(rows: &[Row], against: &str, metric: &str) -> anyhow::Result<String> {
    let reference = rows
        .iter()
        .find(|r| r.label == against)
        .ok_or_else(|| anyhow::anyhow!("--against {against:?} names no row"))?;
    let reference = per_task(reference, metric)?;
    let width = rows.iter().map(|r| r.label.len()).max().unwrap_or(0).max(9);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<width$}  {:>5}  {:<22}  {:<26}  {:>8}  {:>5}  {:>6}",
        "contender",
        "tasks",
        format!("{metric} [95 %]"),
        format!("vs {against} [95 % paired]"),
        "failures",
        "turns",
        "tokens"
    );
    for row in rows {
        let per_task = per_task(row, metric)?;
        let scores: Vec<f64> = per_task.values().copied().collect();
        let mean = mean_interval(&scores, SEED).map_or_else(|| "-".to_owned(), |i| shown(i, false));
        let delta = if row.label == against {
            "reference".to_owned()
        } else {
            paired_interval(per_task.iter().map(|(t, s)| (t.as_str(), *s)), &reference, SEED).map_or_else(
                || "no task in common".to_owned(),
                |(i, _)| format!("{}{}", shown(i, true), i.verdict(" better", " worse")),
            )
        };
        let metric = |name: &str| row.evaluation.metrics.get(name).copied().unwrap_or_default();
        let _ = writeln!(
            out,
            "{:<width$}  {:>5}  {mean:<22}  {delta:<26}  {:>8.3}  {:>5.2}  {:>6.0}",
            row.label,
            scores.len(),
            failure_rate(&row.evaluation.metrics),
            metric("turns"),
            metric("tokens"),
        );
    }
    Ok(out)
}

fn shown(i: Interval, signed: bool) -> String {
    if signed {
        format!("{:+.3} [{:+.3}, {:+.3}]", i.mean, i.low, i.high)
    } else {
        format!("{:.3} [{:.3}, {:.3}]", i.mean, i.low, i.high)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(label: &str, scores: &[f64], failures: f64) -> Row {
        let per_task = scores
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("q{i}"), pb::TaskMetrics { metrics: [("answer_f1".to_owned(), *s)].into() }))
            .collect();
        let metrics = [("failure_rate:turn_limit".to_owned(), failures), ("turns".to_owned(), 2.5)].into();
        Row {
            label: label.into(),
            evaluation: pb::Evaluation {
                per_task,
                metrics,
                status: pb::RunStatus::Succeeded as i32,
                ..Default::default()
            },
        }
    }

    #[test]
    fn rows_are_compared_pairwise_with_the_reference() {
        let sft: Vec<f64> = (0..40).map(|i| f64::from(i % 4) / 4.0).collect();
        let better: Vec<f64> = sft.iter().map(|s| s + 0.2).collect();
        let rows = [row("sft", &sft, 0.0), row("grpo", &better, 0.05)];
        let table = table(&rows, "sft", "answer_f1").unwrap();
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].contains("answer_f1 [95 %]") && lines[0].contains("vs sft [95 % paired]"), "{table}");
        assert!(lines[1].starts_with("sft") && lines[1].contains("reference"), "{table}");
        assert!(lines[2].contains("+0.200 [+0.200, +0.200] better"), "{table}");
        assert!(lines[2].contains("0.050") && lines[2].contains("2.50"), "{table}");
        assert!(super::table(&rows, "bm25", "answer_f1").unwrap_err().to_string().contains("\"bm25\""));
        let unrecorded = super::table(&rows, "sft", "ndcg@10").unwrap_err().to_string();
        assert!(unrecorded.contains("\"ndcg@10\"") && unrecorded.contains("answer_f1"), "{unrecorded}");
    }
}
