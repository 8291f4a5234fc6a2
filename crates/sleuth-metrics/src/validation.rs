//! Choosing among a run's validated versions: by the held-out mean of the
//! reward's headline metric (nDCG@10 for rankings, answer F1 for answers,
//! see `Reward::headline`), never by training reward (policies trained with
//! RL over-optimise late in a run).

use sleuth_proto::rollout::v1::Validation;

/// The metric versions are chosen by: every evaluation records the mean of
/// its reward's headline metric under this name.
pub const CHOSEN_BY: &str = "score";

/// What validations recorded before they carried [`CHOSEN_BY`] were chosen
/// by (every run then was scored by nDCG@10).
const CHOSEN_BY_BEFORE: &str = "ndcg@10";

/// What `validation` is chosen by: its [`CHOSEN_BY`] score, or for one
/// recorded before scores its nDCG@10.
pub fn score(validation: &Validation) -> Option<f64> {
    validation.metrics.get(CHOSEN_BY).or_else(|| validation.metrics.get(CHOSEN_BY_BEFORE)).copied()
}

/// Validated versions, best first: the highest score, the earliest of
/// equals first (a later version must do better to be preferred).
pub fn ranked_versions(validations: &[Validation]) -> Vec<u64> {
    let score = |v: &Validation| score(v).filter(|s| s.is_finite()).unwrap_or(f64::MIN);
    let mut ranked: Vec<&Validation> = validations.iter().collect();
    ranked.sort_by(|a, b| score(b).total_cmp(&score(a)).then(a.version.cmp(&b.version)));
    ranked.into_iter().map(|v| v.version).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validation(version: u64, ndcg: f64) -> Validation {
        Validation { version, metrics: [(CHOSEN_BY.to_owned(), ndcg)].into(), ..Default::default() }
    }

    #[test]
    fn the_best_score_comes_first_and_ties_go_to_the_earliest() {
        let validations = [validation(0, 0.1), validation(2, 0.4), validation(4, 0.4), validation(6, 0.3)];
        assert_eq!(ranked_versions(&validations), [2, 4, 6, 0]);
        assert_eq!(ranked_versions(&[]), Vec::<u64>::new());
        let before = Validation { version: 8, metrics: [("ndcg@10".to_owned(), 0.5)].into(), ..Default::default() };
        assert_eq!(ranked_versions(&[validation(2, 0.4), before]), [8, 2], "recorded before scores: by nDCG@10");
    }
}
