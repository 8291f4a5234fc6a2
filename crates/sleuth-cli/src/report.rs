//! `sleuth run report RUN`: a run's learning curve as one table, per policy
//! version: the training episodes it sampled (reward, nDCG@10, failures) and
//! its validation (score: the reward's headline metric, reward, failure
//! rate, turns), the best validated version marked. `--csv` writes the same rows for plotting.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use sleuth_metrics::reward::failure_rate;
use sleuth_proto::rollout::v1 as pb;

/// One version's row: training and validation side by side (either may be missing).
struct Row<'a> {
    training: Option<&'a pb::VersionStats>,
    validation: Option<&'a pb::Validation>,
}

fn rows(run: &pb::Run) -> BTreeMap<u64, Row<'_>> {
    let mut rows: BTreeMap<u64, Row<'_>> = BTreeMap::new();
    for stats in &run.training {
        rows.entry(stats.version).or_insert(Row { training: None, validation: None }).training = Some(stats);
    }
    for validation in &run.validations {
        rows.entry(validation.version).or_insert(Row { training: None, validation: None }).validation =
            Some(validation);
    }
    rows
}

/// A row's eight values after the version, `None` where a side is missing.
fn cells(row: &Row<'_>) -> [Option<f64>; 8] {
    let (t, v) = (row.training, row.validation);
    let metric = |name: &str| v.and_then(|v| v.metrics.get(name).copied());
    [
        t.map(|t| t.episodes as f64),
        t.map(|t| t.reward_mean),
        t.map(|t| t.ndcg_mean),
        t.map(|t| t.failure_rate),
        v.and_then(sleuth_metrics::validation::score),
        metric("reward"),
        v.map(|v| failure_rate(&v.metrics)),
        metric("turns"),
    ]
}

/// The table `sleuth run report` prints.
pub fn table(run: &pb::Run) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>8}  {:>8} {:>8} {:>8} {:>8}  {:>9} {:>8} {:>8} {:>6}",
        "version", "episodes", "reward", "nDCG@10", "failures", "val score", "val rew", "val fail", "turns"
    );
    for (version, row) in rows(run) {
        let [episodes, rest @ ..] = cells(&row);
        let shown: Vec<String> = rest.iter().map(|c| c.map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"))).collect();
        let best = if row.validation.is_some() && version == run.best_version { " *" } else { "" };
        let _ = writeln!(
            out,
            "{version:>8}  {:>8} {:>8} {:>8} {:>8}  {:>9} {:>8} {:>8} {:>6}{best}",
            episodes.map_or_else(|| "-".to_owned(), |n| n.to_string()),
            shown[0],
            shown[1],
            shown[2],
            shown[3],
            shown[4],
            shown[5],
            shown[6],
        );
    }
    if run.validations.is_empty() {
        out.push_str("no validation yet (spec.validation and training.eval_every)\n");
    } else {
        let _ = writeln!(out, "* best version by validation score: {}", run.best_version);
    }
    out
}

/// The same rows as CSV (empty fields where a side is missing).
pub fn csv(run: &pb::Run) -> String {
    let mut out = String::from(
        "version,episodes,train_reward,train_ndcg,train_failure_rate,val_score,val_reward,val_failure_rate,val_turns\n",
    );
    for (version, row) in rows(run) {
        let fields: Vec<String> = cells(&row).iter().map(|c| c.map(|v| v.to_string()).unwrap_or_default()).collect();
        let _ = writeln!(out, "{version},{}", fields.join(","));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_and_validation_meet_per_version_and_the_best_is_marked() {
        let run = pb::Run {
            training: vec![
                pb::VersionStats { version: 0, episodes: 8, reward_mean: 0.1, ..Default::default() },
                pb::VersionStats { version: 1, episodes: 8, reward_mean: 0.4, ..Default::default() },
            ],
            validations: vec![
                pb::Validation {
                    version: 0,
                    metrics: [("ndcg@10".into(), 0.2), ("failure_rate:turn_limit".into(), 0.25)].into(),
                    ..Default::default()
                },
                pb::Validation { version: 2, metrics: [("ndcg@10".into(), 0.5)].into(), ..Default::default() },
            ],
            best_version: 2,
            ..Default::default()
        };
        let table = table(&run);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 5, "{table}");
        assert!(lines[1].trim_start().starts_with('0') && lines[1].contains("0.250"), "{table}");
        assert!(lines[3].ends_with(" *") && lines[3].contains("0.500"), "{table}");
        assert!(lines[4].contains("best version by validation score: 2"));
        let csv = csv(&run);
        assert_eq!(csv.lines().nth(3), Some("2,,,,,0.5,,0,"));
    }
}
