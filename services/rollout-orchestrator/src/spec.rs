//! Checking a run spec at `CreateRun`: every bad field named, and fields
//! that only make sense together (a validation set and its interval, a
//! reward threshold and a teacher) refused alone rather than ignored.

use sleuth_proto::rollout::v1 as pb;

use sleuth_proto::common::v1::Task;

use crate::tasks;

/// Validation during training needs both a validation set and an interval,
/// and a validation set that shares no question with the training set.
fn validate_validation(spec: &pb::RunSpec, train: &[Task], roots: &sleuth_store::LocalRoots) -> Result<(), String> {
    let eval_every = spec.training.as_ref().map_or(0, |t| t.eval_every);
    let Some(set) = &spec.validation else {
        if eval_every > 0 {
            return Err("spec.training.eval_every needs spec.validation (the task set to evaluate on)".into());
        }
        return Ok(());
    };
    if eval_every == 0 {
        return Err("spec.validation needs spec.training.eval_every (validate every this many versions)".into());
    }
    let validation = tasks::load(set, "spec.validation", roots)?;
    let trained: std::collections::HashSet<(&str, &str)> =
        train.iter().map(|t| (t.collection.as_str(), t.task_id.as_str())).collect();
    if let Some(shared) = validation.iter().find(|t| trained.contains(&(t.collection.as_str(), t.task_id.as_str()))) {
        return Err(format!(
            "spec.validation shares question {:?} with spec.train: validation must be held out (another split)",
            shared.task_id
        ));
    }
    Ok(())
}

/// The training settings the learner takes from the spec (see the learner's
/// `run_spec`), checked here so a bad one fails `CreateRun`, not the learner.
/// The most rehearsed conversations per step: each is a sample of the step,
/// so thousands would drown the episodes (and a typo in a spec should not
/// make a step of a million samples).
const MAX_COPY_REHEARSAL: u32 = 1024;

fn validate_training(training: &pb::TrainingSpec) -> Result<(), String> {
    use sleuth_metrics::advantage::Estimator;
    use sleuth_metrics::policy_loss::PolicyLoss;
    training.advantage.parse::<Estimator>().map_err(|e| format!("spec.training.{e}"))?;
    training.loss.parse::<PolicyLoss>().map_err(|e| format!("spec.training.{e}"))?;
    training.lr_schedule.parse::<sleuth_metrics::schedule::LrSchedule>().map_err(|e| format!("spec.training.{e}"))?;
    for (field, value) in [("learning_rate", training.learning_rate), ("kl_coef", training.kl_coef)] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(format!("spec.training.{field} must be a finite number >= 0, got {value}"));
        }
    }
    Ok(())
}

/// The start model's URI (checked by the learner, which reads it): an
/// `s3://bucket/prefix` or an absolute directory path, as the learner's pod
/// sees it (this pod may not have the file).
fn validate_model_uri(uri: &str) -> Result<(), String> {
    let path = uri.strip_prefix("file://").unwrap_or(uri);
    let s3_bucket = uri.strip_prefix("s3://").map(|rest| rest.split('/').next().unwrap_or_default());
    match s3_bucket {
        Some("") => Err(format!("spec.policy.model_uri {uri:?} names no bucket")),
        Some(_) => Ok(()),
        None if std::path::Path::new(path).is_absolute() => Ok(()),
        None => Err(format!("spec.policy.model_uri {uri:?} must be an absolute directory path or s3://bucket/prefix")),
    }
}

/// The most episodes of one task at once: a training group, or an
/// evaluation's samples per task. Bounds what one request makes the mesh do.
pub const MAX_SAMPLES_PER_TASK: u32 = 64;

/// Checks a run spec, naming the first bad field.
pub fn validate(spec: &pb::RunSpec, roots: &sleuth_store::LocalRoots) -> Result<(), String> {
    if !(1..=MAX_SAMPLES_PER_TASK).contains(&spec.group_size) {
        return Err(format!("spec.group_size must be 1..={MAX_SAMPLES_PER_TASK}, got {}", spec.group_size));
    }
    let budget = spec.agent.as_ref().and_then(|a| a.budget).unwrap_or_default();
    let most = sleuth_kit::limits::MAX_EPISODE_TOKENS;
    if budget.max_episode_tokens > most {
        return Err(format!(
            "spec.agent.budget.max_episode_tokens must be at most {most} (an episode must fit one message), got {}",
            budget.max_episode_tokens
        ));
    }
    if spec.global_batch_size == 0 {
        return Err("spec.global_batch_size must be at least 1".into());
    }
    if spec.rollout_max_concurrency == 0 {
        return Err("spec.rollout_max_concurrency must be at least 1".into());
    }
    let train = spec.train.as_ref().ok_or("spec.train is required")?;
    let teacher = match &spec.agent {
        Some(agent) => {
            agent::episode::check_opening_search(agent).map_err(|e| format!("spec.agent.{e}"))?;
            agent::teacher::TeacherSpec::parse(&agent.teacher).map_err(|e| format!("spec.agent.{e}"))?
        }
        None => None,
    };
    if teacher.is_none() && spec.training.as_ref().is_some_and(|t| t.sft_min_reward != 0.0) {
        return Err(
            "spec.training.sft_min_reward applies to trajectory SFT: set spec.agent.teacher or remove it".into()
        );
    }
    if let Some(rehearsal) = spec.training.as_ref().map(|t| t.copy_rehearsal).filter(|n| *n > 0) {
        if teacher.is_none() {
            return Err(format!(
                "spec.training.copy_rehearsal {rehearsal} applies to trajectory SFT: set spec.agent.teacher or remove it"
            ));
        }
        if rehearsal > MAX_COPY_REHEARSAL {
            return Err(format!("spec.training.copy_rehearsal must be at most {MAX_COPY_REHEARSAL}, got {rehearsal}"));
        }
        // Rehearsed conversations offer the tools the episodes offer, so the
        // learner needs them named (an empty list means "whatever the
        // gateway has", which the learner cannot know).
        let tools = spec.agent.as_ref().map(|a| a.tools.as_slice()).unwrap_or_default();
        if !tools.iter().any(|t| sleuth_chat::tools::SEARCH_TOOLS.contains(&t.as_str())) {
            return Err(format!(
                "spec.training.copy_rehearsal {rehearsal} needs spec.agent.tools to name a search tool ({}), got {tools:?}",
                sleuth_chat::tools::SEARCH_TOOLS.join(", ")
            ));
        }
    }
    if let Some(policy) = spec.policy.as_ref().filter(|p| !p.from_run.is_empty()) {
        if !policy.model_uri.is_empty() {
            return Err("spec.policy sets both model_uri and from_run; a run starts from one of them".into());
        }
        sleuth_kit::names::check_name("spec.policy.from_run", &policy.from_run).map_err(|e| e.to_string())?;
    }
    if let Some(policy) = spec.policy.as_ref().filter(|p| !p.model_uri.is_empty()) {
        validate_model_uri(&policy.model_uri)?;
    }
    if let Some(training) = &spec.training {
        validate_training(training)?;
    }
    let reward = sleuth_metrics::reward::of_spec(spec.reward.as_ref()).map_err(|e| format!("spec.reward.{e}"))?;
    // Last: they read the task sets.
    let train = tasks::load(train, "spec.train", roots)?;
    sleuth_metrics::reward::check_tasks(reward.as_ref(), &train).map_err(|e| format!("spec.train: {e}"))?;
    validate_validation(spec, &train, roots)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every local path: these tests check the spec, not the roots.
    fn validate(spec: &pb::RunSpec) -> Result<(), String> {
        super::validate(spec, &sleuth_store::LocalRoots { roots: vec!["/".into()], setting: tasks::ROOTS_SETTING })
    }

    #[test]
    fn a_teacher_and_its_settings_are_checked() {
        let with_teacher = |teacher: &str| pb::RunSpec {
            agent: Some(sleuth_proto::agent::v1::AgentConfig { teacher: teacher.into(), ..Default::default() }),
            group_size: 1,
            global_batch_size: 1,
            rollout_max_concurrency: 1,
            train: Some(pb::TaskSet::default()),
            ..Default::default()
        };
        let error = validate(&with_teacher("oracle")).unwrap_err();
        assert!(error.contains("spec.agent.teacher \"oracle\""), "{error}");
        let opening = |tool: &str, tools: &[&str]| pb::RunSpec {
            agent: Some(sleuth_proto::agent::v1::AgentConfig {
                opening_search: tool.into(),
                tools: tools.iter().map(|t| (*t).to_owned()).collect(),
                ..Default::default()
            }),
            ..with_teacher("")
        };
        let error = validate(&opening("read_document", &[])).unwrap_err();
        assert!(error.contains("spec.agent.opening_search \"read_document\" is not a search tool"), "{error}");
        let error = validate(&opening("vector_search", &["bm25_search"])).unwrap_err();
        assert!(error.contains("spec.agent.opening_search \"vector_search\" is not among"), "{error}");
        let rehearsing = |teacher: &str, copy_rehearsal| pb::RunSpec {
            training: Some(pb::TrainingSpec { copy_rehearsal, ..Default::default() }),
            ..with_teacher(teacher)
        };
        let error = validate(&rehearsing("", 16)).unwrap_err();
        assert!(error.contains("spec.training.copy_rehearsal 16 applies to trajectory SFT"), "{error}");
        let error = validate(&rehearsing("mixture", 5000)).unwrap_err();
        assert!(error.contains("spec.training.copy_rehearsal must be at most 1024, got 5000"), "{error}");
        let error = validate(&rehearsing("mixture", 16)).unwrap_err();
        assert!(error.contains("copy_rehearsal 16 needs spec.agent.tools to name a search tool"), "{error}");
    }

    #[test]
    fn validation_needs_its_interval_and_held_out_questions() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("qrels")).unwrap();
        std::fs::write(dir.path().join("corpus.jsonl"), r#"{"_id": "d", "text": "x"}"#).unwrap();
        std::fs::write(
            dir.path().join("queries.jsonl"),
            "{\"_id\": \"q1\", \"text\": \"a\"}\n{\"_id\": \"q2\", \"text\": \"b\"}",
        )
        .unwrap();
        for (split, queries) in [("train", "q1"), ("dev", "q2"), ("mixed", "q1")] {
            std::fs::write(dir.path().join(format!("qrels/{split}.tsv")), format!("{queries}\td\t1\n")).unwrap();
        }
        let set = |split: &str| pb::TaskSet {
            source_uri: dir.path().display().to_string(),
            collection: "c".into(),
            split: split.into(),
            limit: 0,
        };
        let spec = |validation: Option<&str>, eval_every| pb::RunSpec {
            group_size: 1,
            global_batch_size: 1,
            rollout_max_concurrency: 1,
            train: Some(set("train")),
            validation: validation.map(set),
            training: Some(pb::TrainingSpec { eval_every, ..Default::default() }),
            ..Default::default()
        };
        assert_eq!(validate(&spec(Some("dev"), 2)), Ok(()));
        assert_eq!(validate(&spec(None, 0)), Ok(()));
        assert!(validate(&spec(None, 2)).unwrap_err().contains("spec.training.eval_every needs spec.validation"));
        assert!(
            validate(&spec(Some("dev"), 0)).unwrap_err().contains("spec.validation needs spec.training.eval_every")
        );
        assert!(validate(&spec(Some("mixed"), 2)).unwrap_err().contains("shares question \"q1\""));
    }

    #[test]
    fn start_models_are_absolute_paths_or_s3() {
        assert_eq!(validate_model_uri("/models/sft"), Ok(()));
        assert_eq!(validate_model_uri("file:///models/sft"), Ok(()));
        assert_eq!(validate_model_uri("s3://bucket/runs/sft/step-00000010/hf"), Ok(()));
        assert!(validate_model_uri("models/sft").unwrap_err().contains("absolute"));
        assert!(validate_model_uri("s3:///x").unwrap_err().contains("no bucket"));
    }

    #[test]
    fn bad_training_settings_are_named() {
        let training = |edit: fn(&mut pb::TrainingSpec)| {
            let mut training = pb::TrainingSpec::default();
            edit(&mut training);
            validate_training(&training)
        };
        assert_eq!(training(|_| {}), Ok(()));
        assert!(training(|t| t.loss = "ppo2".into()).unwrap_err().contains("spec.training.loss \"ppo2\""));
        assert!(training(|t| t.advantage = "gae".into()).unwrap_err().contains("spec.training.advantage \"gae\""));
        assert!(training(|t| t.learning_rate = -1.0).unwrap_err().contains("spec.training.learning_rate"));
        assert!(
            training(|t| t.lr_schedule = "step".into()).unwrap_err().contains("spec.training.lr_schedule \"step\"")
        );
        assert!(training(|t| t.kl_coef = f64::NAN).unwrap_err().contains("spec.training.kl_coef"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 10_000, ..Default::default() })]

        /// Any spec: valid, or refused with the offending field named; never a panic.
        #[test]
        fn any_spec_is_valid_or_names_its_field(
            sizes in (proptest::prelude::any::<u32>(), 0u32..3, 0u32..3, 0u32..3),
            teacher in proptest::prop_oneof!["(bm25|vector|sql):[0-9]{1,2}", "mixture", "\\PC{0,8}", proptest::strategy::Just(String::new())],
            numbers in (proptest::prelude::any::<f64>(), proptest::prelude::any::<f64>(), proptest::prelude::any::<f64>(), 0u32..3),
            names in ("\\PC{0,10}", "\\PC{0,10}", proptest::prop_oneof!["s3://[a-z]{0,4}(/x)?", "/abs/[a-z]{1,4}", "\\PC{0,10}"]),
            penalties in proptest::collection::btree_map("\\PC{0,12}", proptest::prelude::any::<f64>(), 0..3),
            source in proptest::prop_oneof!["\\PC{0,12}", proptest::strategy::Just("/nonexistent/beir".to_owned())],
        ) {
            let (group_size, global_batch_size, rollout_max_concurrency, eval_every) = sizes;
            let (learning_rate, kl_coef, sft_min_reward, checkpoint_every) = numbers;
            let copy_rehearsal = checkpoint_every * 700;
            let (advantage, loss, model_uri) = names;
            let lr_schedule = if checkpoint_every == 1 { "cosine".to_owned() } else { advantage.clone() };
            let task_set = pb::TaskSet { source_uri: source, collection: "c".into(), split: "test".into(), limit: 0 };
            let spec = pb::RunSpec {
                group_size: group_size % 70,
                global_batch_size,
                rollout_max_concurrency,
                agent: Some(sleuth_proto::agent::v1::AgentConfig { teacher, ..Default::default() }),
                policy: Some(pb::PolicySpec { model_uri, ..Default::default() }),
                train: Some(task_set.clone()),
                validation: (eval_every == 1).then_some(task_set),
                training: Some(pb::TrainingSpec {
                    advantage,
                    loss,
                    learning_rate,
                    kl_coef,
                    sft_min_reward,
                    checkpoint_every,
                    eval_every,
                    copy_rehearsal,
                    lr_schedule,
                }),
                reward: Some(pb::RewardSpec { name: String::new(), outcome_penalties: penalties.into_iter().collect() }),
                ..Default::default()
            };
            if let Err(error) = validate(&spec) {
                proptest::prop_assert!(error.contains("spec."), "{error}");
            }
        }
    }
}
