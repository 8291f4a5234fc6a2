//! Evaluation jobs: the same harness for every contender (a policy through
//! the agent workers, or a named retrieval baseline through the tool
//! gateway), scored with the same metric code as training rewards, so the
//! model is the only variable.
//!
//! Baselines are named in `policy.model_uri`: `baseline:bm25`,
//! `baseline:vector`, `baseline:hybrid`, `baseline:rm3` (one search of the
//! question; rm3 is BM25 with RM3 pseudo-relevance feedback).
//! Each job writes `<report_dir>/<id>.run` (TREC run file of each task's
//! first sample), `<report_dir>/<id>.json` (the metrics) and, once it ends,
//! `<report_dir>/<id>.evaluation.pb` (the job itself, see [`crate::jobs`]).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use futures::StreamExt;
use sleuth_kit::client::MeshChannel;
use sleuth_metrics::reward::{FAILURE_RATE, NdcgReward, Reward, outcome_name};
use sleuth_metrics::validation::CHOSEN_BY;
use sleuth_proto::agent::v1::RunEpisodeRequest;
use sleuth_proto::common::v1::{Episode, EpisodeOutcome, SegmentKind, Task};
use sleuth_proto::rollout::v1::{EvaluateRequest, Evaluation, RunStatus, TaskMetrics};
use sleuth_proto::tools::v1::tool_gateway_client::ToolGatewayClient;
use sleuth_proto::tools::v1::{SearchMethod, SearchRequest};

use crate::scoring::Scorer;
use crate::workers::Workers;

/// Tasks evaluated at once.
const PARALLEL_TASKS: usize = 8;
/// Ranking depth of baselines (recall needs more than the 10 nDCG scores).
const BASELINE_DEPTH: u32 = 100;

/// What is being evaluated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Contender {
    Baseline(SearchMethod),
    /// The policy the policy servers currently serve, through the agent workers.
    Policy,
}

impl Contender {
    /// The name `parse` reads (`policy` for the served policy).
    pub fn name(self) -> &'static str {
        match self {
            Self::Baseline(SearchMethod::Bm25) => "baseline:bm25",
            Self::Baseline(SearchMethod::Vector) => "baseline:vector",
            Self::Baseline(SearchMethod::Bm25Rm3) => "baseline:rm3",
            Self::Baseline(_) => "baseline:hybrid",
            Self::Policy => "policy",
        }
    }

    pub fn parse(model_uri: &str) -> Result<Self, String> {
        match model_uri {
            "" => Ok(Self::Policy),
            "baseline:bm25" => Ok(Self::Baseline(SearchMethod::Bm25)),
            "baseline:vector" => Ok(Self::Baseline(SearchMethod::Vector)),
            "baseline:hybrid" => Ok(Self::Baseline(SearchMethod::Hybrid)),
            "baseline:rm3" => Ok(Self::Baseline(SearchMethod::Bm25Rm3)),
            other if other.starts_with("baseline:") => Err(format!(
                "policy.model_uri {other:?}: baselines are baseline:bm25, baseline:vector, baseline:hybrid, \
                 baseline:rm3"
            )),
            other => Err(format!(
                "policy.model_uri {other:?}: evaluating a model directory needs policy servers serving it; \
                 load it there (UpdateWeights) and leave model_uri empty"
            )),
        }
    }
}

/// One task's samples: their metrics, rankings (best first, with scores)
/// and outcomes.
struct Scored {
    task_id: String,
    /// The metric [`CHOSEN_BY`] means: the reward's headline.
    headline: String,
    metrics: Vec<BTreeMap<String, f64>>,
    reward: Vec<f64>,
    outcomes: Vec<EpisodeOutcome>,
    turns: Vec<u32>,
    tokens: Vec<u32>,
    first_ranking: Vec<(String, f64)>,
    /// The policy versions that sampled the episodes' tokens (from their
    /// traces), oldest and newest; `None` when no token was sampled.
    served: Option<(u64, u64)>,
}

impl Scored {
    fn new(task_id: &str, headline: &str) -> Self {
        Self {
            task_id: task_id.to_owned(),
            headline: headline.to_owned(),
            metrics: Vec::new(),
            reward: Vec::new(),
            outcomes: Vec::new(),
            turns: Vec::new(),
            tokens: Vec::new(),
            first_ranking: Vec::new(),
            served: None,
        }
    }

    /// Adds one sample's score.
    fn add(&mut self, scored: sleuth_metrics::reward::Scored, episode: &Episode) {
        self.metrics.push(scored.metrics);
        self.reward.push(scored.reward);
        self.outcomes.push(episode.outcome());
        self.turns.push(episode.turns);
        self.tokens.push(episode.total_tokens);
    }

    /// `metric` of each sample (0 where a sample lacks it).
    fn each(&self, metric: &str) -> impl Iterator<Item = f64> {
        self.metrics.iter().map(move |m| m.get(metric).copied().unwrap_or(0.0))
    }

    /// The mean of `metric` over the task's samples.
    fn mean(&self, metric: &str) -> f64 {
        self.each(metric).sum::<f64>() / self.metrics.len().max(1) as f64
    }

    /// The task's metrics: each the mean over its samples, with the mean
    /// reward and the headline's mean as [`CHOSEN_BY`].
    fn means(&self) -> BTreeMap<String, f64> {
        let mut means: BTreeMap<String, f64> =
            self.metrics.iter().flat_map(|m| m.keys()).map(|name| (name.clone(), self.mean(name))).collect();
        means.insert("reward".to_owned(), self.reward.iter().sum::<f64>() / self.reward.len().max(1) as f64);
        means.insert(CHOSEN_BY.to_owned(), self.mean(&self.headline));
        means
    }
}

/// What an evaluation job returns: its metrics and each task's.
pub(crate) struct Outcome {
    pub metrics: HashMap<String, f64>,
    pub per_task: BTreeMap<String, BTreeMap<String, f64>>,
}

impl Outcome {
    /// `job` succeeded with this outcome: its metrics, and each task's
    /// (every metric, and nDCG@10 alone where the reward records it).
    pub fn succeeded(self, job: &mut Evaluation) {
        let Outcome { metrics, per_task } = self;
        job.metrics = metrics;
        job.per_task_ndcg = ndcg_by_task(&per_task).into_iter().collect();
        job.per_task = per_task
            .into_iter()
            .map(|(task, metrics)| (task, TaskMetrics { metrics: metrics.into_iter().collect() }))
            .collect();
        job.status = RunStatus::Succeeded as i32;
    }
}

#[derive(Clone)]
pub struct Evaluator {
    pub tools: Option<ToolGatewayClient<MeshChannel>>,
    pub workers: Workers,
    pub report_dir: PathBuf,
    /// Running and finished jobs (bounded; finished ones kept on disk).
    pub jobs: crate::jobs::Jobs,
    /// The judge of the `judge` reward, when one is configured.
    pub judge: Option<Arc<crate::judge::Judge>>,
    /// Where task sets may be read from (`--task-roots`).
    pub task_roots: sleuth_store::LocalRoots,
}

impl Evaluator {
    /// The scorer of `spec` with this orchestrator's judge.
    pub fn scorer(&self, spec: Option<&sleuth_proto::rollout::v1::RewardSpec>) -> Result<Scorer, String> {
        Scorer::of_spec(spec, self.judge.as_ref())
    }

    /// The job `id`, running or finished (see [`crate::jobs`]).
    pub fn get(&self, id: &str) -> Result<Option<Evaluation>, String> {
        self.jobs.get(id)
    }

    /// Validates and starts a job; returns its first state. The task set is
    /// read off the runtime (blocking file I/O); a job beyond
    /// [`crate::jobs::MAX_RUNNING`] is refused as resource exhausted.
    pub async fn start(&self, request: EvaluateRequest) -> Result<Evaluation, tonic::Status> {
        let invalid = tonic::Status::invalid_argument;
        let most = crate::spec::MAX_SAMPLES_PER_TASK;
        if request.samples_per_task > most {
            return Err(invalid(format!(
                "samples_per_task must be 0..={most} (0 means 1), got {}",
                request.samples_per_task
            )));
        }
        let contender = Contender::parse(&request.policy.as_ref().map(|p| p.model_uri.clone()).unwrap_or_default())
            .map_err(invalid)?;
        let set = request.tasks.clone().ok_or_else(|| invalid("tasks is required".into()))?;
        let tasks = crate::tasks::load_off_runtime(set, "tasks", self.task_roots.clone()).await.map_err(invalid)?;
        let scorer = self.scorer(request.reward.as_ref()).map_err(|e| invalid(format!("reward.{e}")))?;
        if matches!(contender, Contender::Policy) {
            sleuth_metrics::reward::check_tasks(scorer.reward(), &tasks).map_err(|e| invalid(format!("tasks: {e}")))?;
        }
        if matches!(contender, Contender::Baseline(_)) && self.tools.is_none() {
            return Err(invalid("baselines need the orchestrator's tool_gateway address (SLEUTH_TOOL_GATEWAY)".into()));
        }
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let id = format!("eval-{nanos:x}");
        let evaluation = Evaluation {
            evaluation_id: id.clone(),
            status: RunStatus::Running as i32,
            tasks_total: tasks.len() as u64,
            ..Default::default()
        };
        self.jobs.begin(evaluation.clone()).map_err(tonic::Status::resource_exhausted)?;
        let evaluator = self.clone();
        tokio::spawn(async move {
            let result = evaluator.run(&id, contender, tasks, &request, &scorer, None).await;
            evaluator.jobs.finish(&id, |job| match result {
                Ok(outcome) => outcome.succeeded(job),
                Err(error) => {
                    tracing::error!(evaluation = %id, %error, "evaluation failed");
                    job.status = RunStatus::Failed as i32;
                    job.status_detail = error;
                }
            });
        });
        Ok(evaluation)
    }

    /// Evaluates `contender` on `tasks`; writes the report files under `id`.
    /// Returns the metrics and each task's. `of_run` names the
    /// training run whose policy is validated: its episodes are served by
    /// its current weights or newer, never by a server still on older ones.
    pub(crate) async fn run(
        &self,
        id: &str,
        contender: Contender,
        tasks: Vec<Task>,
        request: &EvaluateRequest,
        scorer: &Scorer,
        of_run: Option<&str>,
    ) -> Result<Outcome, String> {
        let of_run = of_run.map(str::to_owned);
        let samples = request.samples_per_task.max(1);
        let scored: Vec<Result<Scored, String>> = futures::stream::iter(tasks)
            .map(|task| {
                let (this, id, request, scorer) = (self.clone(), id.to_owned(), request.clone(), scorer.clone());
                let of_run = of_run.clone();
                async move {
                    let scored = match contender {
                        Contender::Baseline(method) => this.baseline(&task, method).await,
                        Contender::Policy => {
                            this.policy(&id, of_run.as_deref(), &task, samples, &request, &scorer).await
                        }
                    };
                    this.jobs.update(&id, |job| job.tasks_done += 1);
                    scored
                }
            })
            .buffer_unordered(PARALLEL_TASKS)
            .collect()
            .await;
        let scored = scored.into_iter().collect::<Result<Vec<_>, String>>()?;
        let metrics = summarise(&scored, samples as usize);
        let per_task: BTreeMap<String, BTreeMap<String, f64>> =
            scored.iter().map(|s| (s.task_id.clone(), s.means())).collect();
        self.write_reports(id, contender, request, &per_task, &scored, &metrics)
            .map_err(|e| format!("writing the report to {}: {e}", self.report_dir.display()))?;
        Ok(Outcome { metrics: metrics.into_iter().collect(), per_task })
    }

    async fn baseline(&self, task: &Task, method: SearchMethod) -> Result<Scored, String> {
        let mut tools = self.tools.clone().ok_or("no tool gateway")?;
        let request = SearchRequest {
            collection: task.collection.clone(),
            query: task.question.clone(),
            k: BASELINE_DEPTH,
            method: method as i32,
        };
        let hits = tools
            .search(request)
            .await
            .map_err(|s| format!("search for task {}: {}", task.task_id, s.message()))?
            .into_inner()
            .hits;
        let ranking: Vec<String> = hits.iter().map(|h| h.doc_id.clone()).collect();
        let episode = Episode { outcome: EpisodeOutcome::Completed as i32, ranking, ..Default::default() };
        // A baseline ranks; it is scored as a ranking whatever the reward.
        let ranked = NdcgReward::default();
        let mut scored = Scored::new(&task.task_id, sleuth_metrics::reward::NDCG);
        scored.add(ranked.score(task, &episode), &episode);
        scored.first_ranking = hits.into_iter().map(|h| (h.doc_id, f64::from(h.score))).collect();
        Ok(scored)
    }

    async fn policy(
        &self,
        id: &str,
        of_run: Option<&str>,
        task: &Task,
        samples: u32,
        request: &EvaluateRequest,
        scorer: &Scorer,
    ) -> Result<Scored, String> {
        let mut scored = Scored::new(&task.task_id, scorer.reward().headline());
        for sample in 0..samples {
            let episode_request = RunEpisodeRequest {
                // The inference gateway serves a run's turns by its current weights or newer.
                run_id: of_run.unwrap_or(id).to_owned(),
                episode_id: String::new(),
                sample_index: sample,
                task: Some(task.clone()),
                config: request.agent.clone(),
                // Issued per attempt (see `workers::Workers::run_episode`).
                ticket: String::new(),
                group_id: format!("{id}-{}", task.task_id),
            };
            let attempt = |i: usize| format!("{id}-{}-{sample}-{i}", task.task_id);
            // The policy's failures count (0 nDCG, by outcome); the
            // infrastructure's are rerun, or fail the job, never counted.
            let mut episode = self
                .workers
                .run_to_policy_outcome(episode_request, attempt)
                .await
                .map_err(|why| format!("task {}: {why}", task.task_id))?;
            let score =
                scorer.score(task, &mut episode).await.map_err(|why| format!("task {}: {why}", task.task_id))?;
            scored.add(score, &episode);
            let sampled_by = episode
                .trace
                .iter()
                .flat_map(|t| &t.segments)
                .filter(|s| s.kind == SegmentKind::Policy as i32 && !s.token_ids.is_empty())
                .map(|s| s.policy_version);
            for version in sampled_by {
                let (oldest, newest) = scored.served.get_or_insert((version, version));
                (*oldest, *newest) = ((*oldest).min(version), (*newest).max(version));
            }
            if sample == 0 {
                let n = episode.ranking.len() as f64;
                scored.first_ranking =
                    episode.ranking.iter().enumerate().map(|(rank, doc)| (doc.clone(), n - rank as f64)).collect();
            }
        }
        Ok(scored)
    }

    /// The TREC run file, and the JSON report: the metrics, what was
    /// evaluated on which tasks, and each task's metrics (means over its
    /// samples), from which the dashboard draws bootstrap intervals.
    fn write_reports(
        &self,
        id: &str,
        contender: Contender,
        request: &EvaluateRequest,
        per_task: &BTreeMap<String, BTreeMap<String, f64>>,
        scored: &[Scored],
        metrics: &BTreeMap<String, f64>,
    ) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.report_dir)?;
        let rankings: BTreeMap<String, sleuth_metrics::run::ScoredRanking> =
            scored.iter().map(|s| (s.task_id.clone(), s.first_ranking.clone())).collect();
        let mut run = std::io::BufWriter::new(std::fs::File::create(self.report_dir.join(format!("{id}.run")))?);
        sleuth_metrics::run::write_run(&mut run, &rankings, id)?;
        let per_task_ndcg = ndcg_by_task(per_task);
        let set = request.tasks.clone().unwrap_or_default();
        let report = serde_json::json!({
            "evaluation_id": id,
            "contender": contender.name(),
            "collection": set.collection,
            "split": set.split,
            "samples_per_task": request.samples_per_task.max(1),
            "tasks": scored.len(),
            "metrics": metrics,
            "per_task_ndcg@10": per_task_ndcg,
            "per_task": per_task,
        });
        std::fs::write(self.report_dir.join(format!("{id}.json")), serde_json::to_vec_pretty(&report)?)
    }
}

/// Each task's nDCG@10, for the tasks whose metrics record one (a ranking
/// reward's; answer rewards record none).
fn ndcg_by_task(per_task: &BTreeMap<String, BTreeMap<String, f64>>) -> BTreeMap<String, f64> {
    per_task.iter().filter_map(|(task, metrics)| metrics.get("ndcg@10").map(|ndcg| (task.clone(), *ndcg))).collect()
}

/// The job's metrics: each metric the reward records and the mean reward
/// and [`CHOSEN_BY`] (each the mean over tasks of the task's mean over its
/// samples; failed samples count 0), pass@k (a task passes when any of its
/// k samples has a headline metric > 0), mean turns and tokens, and the
/// share of samples per outcome.
fn summarise(scored: &[Scored], k: usize) -> BTreeMap<String, f64> {
    let tasks = scored.len().max(1) as f64;
    let samples: f64 = scored.iter().map(|s| s.metrics.len() as f64).sum::<f64>().max(1.0);
    let mut metrics = BTreeMap::new();
    // Each metric: the mean over tasks of its mean over the task's samples.
    for means in scored.iter().map(Scored::means) {
        for (name, mean) in means {
            *metrics.entry(name).or_insert(0.0) += mean / tasks;
        }
    }
    let passed = scored.iter().filter(|s| s.each(&s.headline).any(|score| score > 0.0)).count();
    metrics.insert(format!("pass@{k}"), passed as f64 / tasks);
    metrics
        .insert("turns".to_owned(), scored.iter().flat_map(|s| &s.turns).map(|&t| f64::from(t)).sum::<f64>() / samples);
    metrics.insert(
        "tokens".to_owned(),
        scored.iter().flat_map(|s| &s.tokens).map(|&t| f64::from(t)).sum::<f64>() / samples,
    );
    for outcome in scored.iter().flat_map(|s| &s.outcomes) {
        if *outcome != EpisodeOutcome::Completed {
            *metrics.entry(format!("{FAILURE_RATE}{}", outcome_name(*outcome))).or_insert(0.0) += 1.0 / samples;
        }
    }
    // Which weights the policy's answers came from: a validation is only
    // one version's when both are that version.
    let served = scored.iter().filter_map(|s| s.served);
    if let Some((oldest, newest)) = served.reduce(|a, b| (a.0.min(b.0), a.1.max(b.1))) {
        metrics.insert(SERVED_OLDEST.to_owned(), oldest as f64);
        metrics.insert(SERVED_NEWEST.to_owned(), newest as f64);
    }
    metrics
}

/// The oldest policy version that sampled a token of a policy evaluation.
pub(crate) const SERVED_OLDEST: &str = "served_version_oldest";
/// The newest policy version that sampled a token of a policy evaluation.
pub(crate) const SERVED_NEWEST: &str = "served_version_newest";
