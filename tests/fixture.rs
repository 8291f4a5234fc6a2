//! Support for rollout tests and benchmarks: a small BEIR collection, tiny
//! policies imprinted to always search or always submit, a mesh of real
//! service processes (tool gateway, policy server, inference gateway, agent
//! workers, orchestrator) around them ([`mesh`]), ways to watch a run
//! ([`stream`]), a headless browser for the dashboard ([`browser`]), and
//! the synthetic collection with a fresh base policy to learn on ([`learning`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use sleuth_kit::client::{MeshChannel, connect};
use sleuth_proto::agent::v1::agent_client::AgentClient;
use sleuth_proto::agent::v1::{AgentConfig, RunEpisodeRequest};
use sleuth_proto::common::v1::{AgentBudget, Episode, SamplingParams, Task};
use sleuth_proto::rollout::v1 as rollout;

use crate::ServiceProcess;

mod browser;
mod learning;
mod mesh;
mod stream;

pub use browser::Browser;
pub use learning::{
    SYNTH, TOOLS, learning_base, prepare_learning_base, small_synth, synth_collection, teacher_mesh, teacher_mesh_with,
};
pub use mesh::Mesh;
pub use stream::*;

pub const SEARCH: &str = r#"<tool_call>[{"name": "bm25_search", "arguments": {"query": "rain clouds"}}]</tool_call>"#;
pub const SUBMIT: &str =
    r#"<tool_call>[{"name": "submit_ranking", "arguments": {"doc_ids": ["rain", "fog"]}}]</tool_call>"#;

/// A tool call the gateway cannot parse (its JSON is cut short).
pub const MALFORMED: &str = r#"<tool_call>[{"name": "bm25_search", "arguments": {"query": </tool_call>"#;

/// Another ranking: right for the snow question, wrong for rain.
pub const SUBMIT_SNOW: &str =
    r#"<tool_call>[{"name": "submit_ranking", "arguments": {"doc_ids": ["snow", "wind"]}}]</tool_call>"#;

/// The mixed policy's replies, each sampled about a third of the time: a
/// group's rankings (so its rewards) differ, and some calls are malformed.
pub const MIXED: [&str; 3] = [SUBMIT, SUBMIT_SNOW, MALFORMED];

/// A five-document BEIR collection, indexed for BM25.
pub fn weather(dir: &Path) -> Result<PathBuf> {
    let source = dir.join("weather");
    std::fs::create_dir_all(source.join("qrels"))?;
    std::fs::write(
        source.join("corpus.jsonl"),
        [
            r#"{"_id": "rain", "title": "Rainfall", "text": "Rain forms when water droplets in clouds grow heavy enough to fall."}"#,
            r#"{"_id": "snow", "title": "Snow", "text": "Snowflakes are ice crystals that form in cold clouds."}"#,
            r#"{"_id": "wind", "title": "Wind", "text": "Wind is air moving from high pressure to low pressure."}"#,
            r#"{"_id": "fog", "title": "Fog", "text": "Fog is a cloud at ground level, made of tiny water droplets."}"#,
            r#"{"_id": "hail", "title": "Hail", "text": "Hailstones grow in thunderstorm updrafts."}"#,
        ]
        .join("\n"),
    )?;
    let questions = [
        ("q1", "why does it rain", "rain"),
        ("q2", "what are snowflakes", "snow"),
        ("q3", "what makes wind blow", "wind"),
        ("q4", "what is fog made of", "fog"),
        ("q5", "how do hailstones grow", "hail"),
        ("q6", "what falls from clouds", "rain"),
    ];
    let queries: Vec<String> =
        questions.iter().map(|(id, text, _)| format!(r#"{{"_id": "{id}", "text": "{text}"}}"#)).collect();
    std::fs::write(source.join("queries.jsonl"), queries.join("\n"))?;
    let mut qrels = String::from("query-id\tcorpus-id\tscore\nq1\tfog\t1\n");
    for (id, _, doc) in questions {
        qrels.push_str(&format!("{id}\t{doc}\t2\n"));
    }
    std::fs::write(source.join("qrels/test.tsv"), qrels)?;
    let index = dir.join("weather-index");
    index_collection(&source, &index, "weather", false)?;
    Ok(index)
}

/// Indexes the BEIR collection at `source` into `out` as `sleuth`'s
/// `tool-gateway index` command does (BM25; document vectors with `vectors`).
pub fn index_collection(source: &Path, out: &Path, name: &str, vectors: bool) -> Result<()> {
    #[derive(clap::Parser)]
    struct Index {
        #[command(flatten)]
        args: tool_gateway::offline::IndexArgs,
    }
    let mut args: Vec<&std::ffi::OsStr> =
        vec!["index".as_ref(), "--source".as_ref(), source.as_os_str(), "--out".as_ref(), out.as_os_str()];
    args.extend([std::ffi::OsStr::new("--name"), name.as_ref()]);
    if vectors {
        args.push("--vectors".as_ref());
    }
    tool_gateway::offline::index(<Index as clap::Parser>::try_parse_from(args)?.args)?;
    Ok(())
}

/// The tools the agent offers on the weather collection, as the template sees them.
pub async fn agent_tools(tools: &ServiceProcess) -> Result<Vec<serde_json::Value>> {
    use sleuth_proto::tools::v1::{ListToolsRequest, tool_gateway_client::ToolGatewayClient};
    sleuth_testkit::service::wait_serving(&tools.addr, "sleuth.tools.v1.ToolGateway").await?;
    let mut client = ToolGatewayClient::new(connect(&tools.addr, None, Duration::from_secs(5)).await?);
    let listed = client.list_tools(ListToolsRequest { collection: "weather".into() }).await?.into_inner();
    let mut specs = listed.tools;
    specs.push(agent::prompt::agent_tool(agent::prompt::SUBMIT_TOOL));
    specs
        .iter()
        .map(|t| {
            let parameters: serde_json::Value = serde_json::from_str(&t.parameters_json)?;
            Ok(serde_json::json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": parameters}}))
        })
        .collect()
}

/// Where the policy imprinted with `replies` for the agent's prompt and
/// `tools` lives, relative to the sleuth cache: the result depends only on these.
fn imprint_path(replies: &[&str], tools: &[serde_json::Value]) -> String {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let key = format!(
        "{}\n{}\n{}",
        replies.join("\n|\n"),
        agent::prompt::SYSTEM_PROMPT,
        serde_json::Value::from(tools.to_vec())
    );
    for byte in key.bytes() {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("test-models/imprint-v10-{hash:016x}")
}

/// The policy imprinted with `replies`, as `make test-fixtures` left it.
pub fn imprinted(replies: &[&str], tools: &[serde_json::Value]) -> Result<PathBuf> {
    sleuth_testkit::prepared_fixture(&imprint_path(replies, tools), "model.safetensors")
}

/// Imprints a policy with `replies` into the cache unless it is there (a few
/// minutes on two cores). A file lock lets two builders share the cache.
pub fn imprint_cached(smollm2: &Path, replies: &[&str], tools: &[serde_json::Value]) -> Result<PathBuf> {
    let dir = sleuth_testkit::cache_dir()?.join(imprint_path(replies, tools));
    if dir.join("model.safetensors").is_file() {
        return Ok(dir);
    }
    let parent = dir.parent().context("cache dir")?;
    std::fs::create_dir_all(parent)?;
    let lock = std::fs::File::create(dir.with_extension("lock"))?;
    lock.lock()?;
    if dir.join("model.safetensors").is_file() {
        return Ok(dir);
    }
    let scratch = tempfile::Builder::new().prefix(".imprint-").tempdir_in(parent)?;
    let partial = scratch.path().join("model");
    let spec = learner::imprint::Imprint { replies, system: agent::prompt::SYSTEM_PROMPT, tools, max_steps: 400 };
    learner::imprint::imprint(smollm2, &partial, &spec)?;
    std::fs::rename(&partial, &dir).with_context(|| format!("moving the imprinted model to {}", dir.display()))?;
    Ok(dir)
}

pub fn request(episode: &str, budget: AgentBudget) -> RunEpisodeRequest {
    RunEpisodeRequest {
        run_id: "test".into(),
        episode_id: episode.into(),
        sample_index: 0,
        task: Some(Task {
            task_id: "q1".into(),
            question: "why does it rain".into(),
            collection: "weather".into(),
            qrels: [("rain".to_owned(), 2), ("fog".to_owned(), 1)].into(),
            answers: Vec::new(),
        }),
        config: Some(AgentConfig {
            budget: Some(budget),
            sampling: Some(SamplingParams { temperature: Some(0.0), ..Default::default() }),
            ..Default::default()
        }),
        ticket: String::new(),
        group_id: String::new(),
    }
}

pub async fn run(agent: &mut AgentClient<MeshChannel>, episode: &str, budget: AgentBudget) -> Result<Episode> {
    agent.run_episode(crate::ticketed(request(episode, budget))).await?.into_inner().episode.context("episode")
}

pub fn budget(max_turns: u32, per_turn: u32, episode: u32) -> AgentBudget {
    AgentBudget { max_turns, max_new_tokens_per_turn: per_turn, max_episode_tokens: episode, observation_char_cap: 300 }
}

/// The tools the agent offers on the weather collection at `index`, read
/// from a tool gateway started for the purpose.
async fn weather_tools(index: &Path) -> Result<Vec<serde_json::Value>> {
    let tools_only = ServiceProcess::start(
        "tool-gateway",
        &[
            ("SLEUTH_COLLECTIONS", format!("weather={}", index.display())),
            ("SLEUTH_INDEX_ROOT", index.display().to_string()),
        ],
    )?;
    agent_tools(&tools_only).await
}

/// The weather collection and the imprinted policies every rollout test uses.
pub struct Policies {
    pub index: PathBuf,
    /// Always calls `bm25_search`.
    pub searcher: PathBuf,
    /// Always submits rain, fog.
    pub submitter: PathBuf,
    /// Always makes a tool call that cannot be parsed.
    pub malformed: PathBuf,
    /// Samples one of [`MIXED`].
    pub mixed: PathBuf,
}

/// The imprinted policies, by name, with the replies each is imprinted with.
pub const IMPRINTS: [(&str, &[&str]); 4] =
    [("searcher", &[SEARCH]), ("submitter", &[SUBMIT]), ("malformed", &[MALFORMED]), ("mixed", &MIXED)];

/// The weather collection indexed under `scratch`, and the imprinted policies.
pub async fn policies(scratch: &Path) -> Result<Policies> {
    let index = weather(scratch)?;
    let tools = weather_tools(&index).await?;
    Ok(Policies {
        searcher: imprinted(&[SEARCH], &tools)?,
        submitter: imprinted(&[SUBMIT], &tools)?,
        malformed: imprinted(&[MALFORMED], &tools)?,
        mixed: imprinted(&MIXED, &tools)?,
        index,
    })
}

/// The tools every imprinted policy is made for: the weather collection's,
/// as the agent offers them (a tool gateway is started to list them).
pub async fn imprint_tools() -> Result<Vec<serde_json::Value>> {
    let scratch = tempfile::tempdir()?;
    weather_tools(&weather(scratch.path())?).await
}

/// Makes the imprinted policy `name` (one of [`IMPRINTS`]) for `tools` unless
/// it is cached, reporting on stderr.
pub fn prepare_policy(name: &str, replies: &[&str], tools: &[serde_json::Value]) -> Result<()> {
    if let Ok(dir) = imprinted(replies, tools) {
        eprintln!("fixtures: imprinted {name} policy cached: {}", dir.display());
        return Ok(());
    }
    let smollm2 = sleuth_testkit::smollm2()?;
    let started = std::time::Instant::now();
    eprintln!("fixtures: imprinting the {name} policy ...");
    let dir = imprint_cached(&smollm2, replies, tools)?;
    eprintln!("fixtures: imprinted {name} policy in {:.0}s: {}", started.elapsed().as_secs_f64(), dir.display());
    Ok(())
}

pub fn spec(
    index: &Path,
    group_size: u32,
    batch: u32,
    concurrency: u32,
    staleness: u32,
    max_turns: u32,
) -> rollout::RunSpec {
    let source = index.parent().map(|p| p.join("weather")).unwrap_or_default();
    rollout::RunSpec {
        name: "test".into(),
        train: Some(rollout::TaskSet {
            source_uri: source.display().to_string(),
            collection: "weather".into(),
            split: "test".into(),
            limit: 0,
        }),
        agent: Some(AgentConfig {
            budget: Some(budget(max_turns, 64, 8192)),
            sampling: Some(SamplingParams { temperature: Some(0.0), ..Default::default() }),
            ..Default::default()
        }),
        group_size,
        global_batch_size: batch,
        max_epochs: 1,
        rollout_max_concurrency: concurrency,
        max_staleness: staleness,
        ..Default::default()
    }
}
