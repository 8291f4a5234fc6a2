//! Choosing among a run's validated versions: by held-out nDCG@10, never by
//! training reward (policies trained with RL over-optimise late in a run).

use sleuth_proto::rollout::v1::Validation;

/// The metric versions are chosen by.
pub const CHOSEN_BY: &str = "ndcg@10";

/// Validated versions, best first: highest nDCG@10, the earliest of equals
/// first (a later version must do better to be preferred).
pub fn ranked_versions(validations: &[Validation]) -> Vec<u64> {
    let score = |v: &Validation| v.metrics.get(CHOSEN_BY).copied().filter(|s| s.is_finite()).unwrap_or(f64::MIN);
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
    }
}
