//! `sleuth run create|status|watch|cancel|list` and `sleuth eval`: the
//! rollout orchestrator's API from the command line.
//!
//! Exit codes scripts can rely on: 0 done (a watched run or evaluation
//! succeeded), 1 it failed or was cancelled, or the call failed, 2 bad
//! usage or an invalid spec (clap's usage errors are 2 as well).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use sleuth_kit::BearerToken;
use sleuth_kit::client::MeshChannel;
use sleuth_proto::rollout::v1 as pb;
use sleuth_proto::rollout::v1::rollout_orchestrator_client::RolloutOrchestratorClient;

/// Exit code of an invalid spec or request.
pub const INVALID: i32 = 2;

#[derive(clap::Args, Debug)]
pub struct Endpoint {
    /// Rollout orchestrator address.
    #[arg(long, env = "SLEUTH_ORCHESTRATOR", default_value = "127.0.0.1:50051", global = true)]
    orchestrator: String,
    #[arg(long, env = "SLEUTH_AUTH_TOKEN", hide_env_values = true, global = true)]
    auth_token: Option<BearerToken>,
    /// Sent instead of the mesh token to create and cancel runs, when the
    /// orchestrator gives administration its own token.
    #[command(flatten)]
    admin: sleuth_kit::AdminTokenArgs,
}

#[derive(clap::Subcommand, Debug)]
pub enum RunCommand {
    /// Create a run from a YAML spec (unknown fields are errors).
    Create {
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
        /// Run id (idempotent create; the id of a failed run resumes it); generated when omitted.
        #[arg(long)]
        id: Option<String>,
        /// Follow the run until it ends (exit code from its outcome).
        #[arg(long)]
        watch: bool,
    },
    /// Print a run's status and progress.
    Status { run_id: String },
    /// Print a run's learning curve: training reward and validation per policy version.
    Report {
        run_id: String,
        /// Also write the rows as CSV here (for plotting).
        #[arg(long)]
        csv: Option<PathBuf>,
        /// Where the PNG chart goes (training reward, validation nDCG@10 and
        /// failure rates against the version); default `<run>.png`.
        #[arg(long)]
        png: Option<PathBuf>,
    },
    /// Follow a run's progress until it ends.
    Watch { run_id: String },
    /// Cancel a run.
    Cancel {
        run_id: String,
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// List runs, newest first.
    List {
        #[arg(long, default_value_t = 20)]
        page_size: u32,
    },
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    endpoint: Endpoint,
    #[command(subcommand)]
    command: RunCommand,
}

#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    endpoint: Endpoint,
    /// BEIR directory of the tasks.
    #[arg(long)]
    source: String,
    /// Tool-gateway collection the tasks search.
    #[arg(long)]
    collection: String,
    #[arg(long, default_value = "test")]
    split: String,
    /// At most this many tasks (0 = all).
    #[arg(long, default_value_t = 0)]
    limit: u32,
    /// What to evaluate: `policy` (the policy servers' weights through the agents)
    /// or a baseline on the question: `bm25`, `vector`, `hybrid`, `rm3`
    /// (BM25 with RM3 pseudo-relevance feedback).
    #[arg(long, default_value = "policy")]
    contender: String,
    /// Episodes per task (pass@k uses k = this).
    #[arg(long, default_value_t = 1)]
    samples: u32,
    /// With `--contender policy`: a teacher replies instead of the
    /// policy (`bm25:<hops>`, `vector:<hops>`, `mixture` or `model:<name>`), to score it.
    #[arg(long, default_value = "")]
    teacher: String,
    /// With `--contender policy`: the agent settings (budget, prompt, tools)
    /// of this run's spec, greedy, as its validations use them; default:
    /// the agent's defaults.
    #[arg(long)]
    agent_from: Option<String>,
    /// The reward the policy's episodes are scored by (`ndcg@10`,
    /// `answer_f1`, `answer_em`, `citations`, `answer+citations`); default:
    /// that of the `--agent-from` run, else `ndcg@10`. Baselines rank, and
    /// are scored by nDCG@10 whatever this says.
    #[arg(long)]
    reward: Option<String>,
    /// With `--contender policy`: the tools offered (`agent.tools`), comma
    /// separated, e.g. `bm25_search,submit_answer` to answer in words;
    /// default: those of the `--agent-from` run, else every tool and
    /// `submit_ranking`.
    #[arg(long, value_delimiter = ',')]
    tools: Option<Vec<String>>,
}

pub(crate) async fn client(endpoint: &Endpoint) -> anyhow::Result<RolloutOrchestratorClient<MeshChannel>> {
    connected(endpoint, endpoint.auth_token.clone()).await
}

/// A client for the calls in the administration scope (creating and cancelling runs, evaluations).
async fn admin_client(endpoint: &Endpoint) -> anyhow::Result<RolloutOrchestratorClient<MeshChannel>> {
    connected(endpoint, endpoint.admin.token()?.or(endpoint.auth_token.clone())).await
}

async fn connected(
    endpoint: &Endpoint,
    token: Option<BearerToken>,
) -> anyhow::Result<RolloutOrchestratorClient<MeshChannel>> {
    let channel = sleuth_kit::client::connect(&endpoint.orchestrator, token.as_ref(), Duration::from_secs(5)).await?;
    Ok(sleuth_kit::sized!(RolloutOrchestratorClient::new(channel)))
}

fn status_name(status: i32) -> &'static str {
    match pb::RunStatus::try_from(status).unwrap_or_default() {
        pb::RunStatus::Unspecified => "unspecified",
        pb::RunStatus::Pending => "pending",
        pb::RunStatus::Running => "running",
        pb::RunStatus::Succeeded => "succeeded",
        pb::RunStatus::Failed => "failed",
        pb::RunStatus::Cancelled => "cancelled",
    }
}

/// `[#####.....] done/total label`: redrawn in place on a terminal; into a
/// log (stdout not a terminal) one line per tenth of the way, so that a
/// long run's log is not all progress lines.
struct Bar {
    /// Whether stdout is a terminal (redraw in place).
    terminal: bool,
    /// The tenth of the way last written to a log.
    shown: Option<u64>,
}

impl Bar {
    fn new() -> Self {
        use std::io::IsTerminal;
        Self { terminal: std::io::stdout().is_terminal(), shown: None }
    }

    fn show(&mut self, done: u64, total: u64, label: &str) {
        let width = 30u64;
        let filled = (done * width).checked_div(total).unwrap_or(0).min(width) as usize;
        let text = format!("[{}{}] {done}/{total} {label}", "#".repeat(filled), ".".repeat(width as usize - filled));
        if self.terminal {
            print!("\r{text}   ");
            let _ = std::io::stdout().flush();
        } else {
            let tenth = (done * 10).checked_div(total).unwrap_or(0);
            if self.shown != Some(tenth) {
                println!("{text}");
                self.shown = Some(tenth);
            }
        }
    }
}

fn print_run(run: &pb::Run) {
    let progress = run.progress.unwrap_or_default();
    println!(
        "{}  {}  groups {}/{}  episodes {} ({} running)  learner step {}  {}",
        run.run_id,
        status_name(run.status),
        progress.groups_published,
        progress.groups_total,
        progress.episodes_finished,
        progress.episodes_in_flight,
        progress.step,
        run.status_detail
    );
}

/// Follows a run; returns the exit code of its outcome.
async fn watch(client: &mut RolloutOrchestratorClient<MeshChannel>, run_id: &str) -> anyhow::Result<i32> {
    let mut events = client.watch_run(pb::WatchRunRequest { run_id: run_id.to_owned() }).await?.into_inner();
    let mut bar = Bar::new();
    while let Some(event) = events.next().await {
        match event?.event {
            Some(pb::run_event::Event::Progress(p)) => bar.show(
                p.groups_published,
                p.groups_total,
                &format!(
                    "groups  {} episodes, {} running, learner step {}",
                    p.episodes_finished, p.episodes_in_flight, p.step
                ),
            ),
            Some(pb::run_event::Event::Status(status)) => {
                println!("\nrun {run_id} {}", status_name(status));
                return Ok(if status == pb::RunStatus::Succeeded as i32 { 0 } else { 1 });
            }
            _ => {}
        }
    }
    anyhow::bail!("the orchestrator closed the watch before the run ended")
}

/// Runs a `sleuth run` command; returns the exit code.
pub async fn run(args: RunArgs) -> anyhow::Result<i32> {
    let mut client = client(&args.endpoint).await?;
    let rpc = |status: tonic::Status| anyhow::anyhow!("{}", status.message());
    match args.command {
        RunCommand::Create { file, id, watch: follow } => {
            let text = std::fs::read_to_string(&file).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            let spec = match crate::run_spec::parse(&text) {
                Ok(spec) => spec,
                Err(error) => {
                    eprintln!("{}: {error}", file.display());
                    return Ok(INVALID);
                }
            };
            let created = admin_client(&args.endpoint)
                .await?
                .create_run(pb::CreateRunRequest { spec: Some(spec), run_id: id.unwrap_or_default() })
                .await;
            let run = match created {
                Ok(run) => run.into_inner(),
                Err(status) if status.code() == tonic::Code::InvalidArgument => {
                    eprintln!("{}: {}", file.display(), status.message());
                    return Ok(INVALID);
                }
                Err(status) => return Err(rpc(status)),
            };
            print_run(&run);
            if follow { watch(&mut client, &run.run_id).await } else { Ok(0) }
        }
        RunCommand::Status { run_id } => {
            print_run(&client.get_run(pb::GetRunRequest { run_id }).await.map_err(rpc)?.into_inner());
            Ok(0)
        }
        RunCommand::Report { run_id, csv, png } => {
            let png = png.unwrap_or_else(|| PathBuf::from(format!("{run_id}.png")));
            let run = client.get_run(pb::GetRunRequest { run_id }).await.map_err(rpc)?.into_inner();
            print_run(&run);
            print!("{}", crate::report::table(&run));
            if let Some(path) = csv {
                std::fs::write(&path, crate::report::csv(&run))
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
                println!("rows written to {}", path.display());
            }
            crate::chart::write_png(&run, &png)?;
            println!("chart written to {}", png.display());
            Ok(0)
        }
        RunCommand::Watch { run_id } => watch(&mut client, &run_id).await,
        RunCommand::Cancel { run_id, reason } => {
            let mut admin = admin_client(&args.endpoint).await?;
            print_run(&admin.cancel_run(pb::CancelRunRequest { run_id, reason }).await.map_err(rpc)?.into_inner());
            Ok(0)
        }
        RunCommand::List { page_size } => {
            let mut token = String::new();
            loop {
                let page = client
                    .list_runs(pb::ListRunsRequest { page_size, page_token: token })
                    .await
                    .map_err(rpc)?
                    .into_inner();
                page.runs.iter().for_each(print_run);
                if page.next_page_token.is_empty() {
                    return Ok(0);
                }
                token = page.next_page_token;
            }
        }
    }
}

/// `sleuth eval`: starts an evaluation job and follows it; returns the exit code.
pub async fn eval(args: EvalArgs) -> anyhow::Result<i32> {
    if (!args.teacher.is_empty() || args.agent_from.is_some() || args.tools.is_some()) && args.contender != "policy" {
        eprintln!("--teacher, --tools and --agent-from set up the agents: they need --contender policy");
        return Ok(INVALID);
    }
    let mut client = client(&args.endpoint).await?;
    let mut reward = None;
    let mut agent = match &args.agent_from {
        Some(run_id) => {
            let run = client
                .get_run(pb::GetRunRequest { run_id: run_id.clone() })
                .await
                .map_err(|s| anyhow::anyhow!("--agent-from {run_id:?}: {}", s.message()))?
                .into_inner();
            reward = run.spec.as_ref().and_then(|spec| spec.reward.clone());
            let mut agent = run.spec.and_then(|spec| spec.agent).unwrap_or_default();
            // Greedy needs no seed; without one a mixture teacher draws its
            // strategy per episode, not one for every task.
            agent.sampling = Some(sleuth_proto::common::v1::SamplingParams {
                temperature: Some(0.0),
                seed: None,
                ..agent.sampling.unwrap_or_default()
            });
            agent
        }
        None => Default::default(),
    };
    agent.teacher = args.teacher.clone();
    if let Some(tools) = &args.tools {
        agent.tools.clone_from(tools);
    }
    if let Some(name) = &args.reward {
        reward = Some(pb::RewardSpec { name: name.clone(), ..reward.unwrap_or_default() });
    }
    let model_uri = if args.contender == "policy" { String::new() } else { format!("baseline:{}", args.contender) };
    let request = pb::EvaluateRequest {
        policy: Some(pb::PolicySpec { model_uri, ..Default::default() }),
        tasks: Some(pb::TaskSet {
            source_uri: args.source,
            collection: args.collection,
            split: args.split,
            limit: args.limit,
        }),
        samples_per_task: args.samples,
        agent: Some(agent),
        reward,
    };
    let started = match admin_client(&args.endpoint).await?.evaluate(request).await {
        Ok(job) => job.into_inner(),
        Err(status) if status.code() == tonic::Code::InvalidArgument => {
            eprintln!("{}", status.message());
            return Ok(INVALID);
        }
        Err(status) => anyhow::bail!("{}", status.message()),
    };
    let mut bar = Bar::new();
    loop {
        let job = client
            .get_evaluation(pb::GetEvaluationRequest { evaluation_id: started.evaluation_id.clone() })
            .await
            .map_err(|s| anyhow::anyhow!("{}", s.message()))?
            .into_inner();
        bar.show(job.tasks_done, job.tasks_total, "tasks");
        if job.status != pb::RunStatus::Running as i32 {
            println!("\nevaluation {} {}", job.evaluation_id, status_name(job.status));
            let mut metrics: Vec<_> = job.metrics.iter().collect();
            metrics.sort_by(|a, b| a.0.cmp(b.0));
            for (name, value) in metrics {
                println!("  {name:<28} {value:.4}");
            }
            if !job.status_detail.is_empty() {
                println!("  {}", job.status_detail);
            }
            return Ok(if job.status == pb::RunStatus::Succeeded as i32 { 0 } else { 1 });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
