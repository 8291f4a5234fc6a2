//! Rollouts across real service processes: agent workers running episodes
//! against the inference gateway (with a policy server) and the tool gateway.
//!
//! The policies are tiny models imprinted (trajectory SFT, `learner::imprint`)
//! to always answer one way, so each budget and outcome can be reached on
//! purpose: one always searches, one always submits a ranking.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use sleuth_kit::client::{MeshChannel, connect};
use sleuth_proto::agent::v1::agent_client::AgentClient;
use sleuth_proto::agent::v1::{AgentConfig, RunEpisodeRequest};
use sleuth_proto::common::v1::{AgentBudget, Episode, EpisodeOutcome, SamplingParams, Task};
use sleuth_tests::ServiceProcess;

const SEARCH: &str = r#"<tool_call>[{"name": "bm25_search", "arguments": {"query": "rain clouds"}}]</tool_call>"#;
const SUBMIT: &str =
    r#"<tool_call>[{"name": "submit_ranking", "arguments": {"doc_ids": ["rain", "fog"]}}]</tool_call>"#;

/// A five-document BEIR collection, indexed for BM25.
fn weather(dir: &Path) -> Result<PathBuf> {
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
    std::fs::write(source.join("queries.jsonl"), r#"{"_id": "q1", "text": "why does it rain"}"#)?;
    std::fs::write(source.join("qrels/test.tsv"), "query-id\tcorpus-id\tscore\nq1\train\t2\nq1\tfog\t1\n")?;
    let index = dir.join("weather-index");
    #[derive(clap::Parser)]
    struct Index {
        #[command(flatten)]
        args: tool_gateway::offline::IndexArgs,
    }
    let index_cli = <Index as clap::Parser>::try_parse_from([
        "index".as_ref(),
        "--source".as_ref(),
        source.as_os_str(),
        "--out".as_ref(),
        index.as_os_str(),
        "--name".as_ref(),
        "weather".as_ref(),
    ])?;
    tool_gateway::offline::index(index_cli.args)?;
    Ok(index)
}

fn smollm2() -> Option<PathBuf> {
    let dir = sleuth_testkit::cache_dir().ok()?.join("models/smollm2-135m-instruct");
    dir.join("tokenizer.json").is_file().then_some(dir).or_else(|| {
        eprintln!("SKIP: SmolLM2 not imported; run `make setup`");
        None
    })
}

/// The tools the agent offers on the weather collection, as the template sees them.
async fn agent_tools(tools: &ServiceProcess) -> Result<Vec<serde_json::Value>> {
    use sleuth_proto::tools::v1::{ListToolsRequest, tool_gateway_client::ToolGatewayClient};
    sleuth_testkit::service::wait_serving(&tools.addr, "sleuth.tools.v1.ToolGateway").await?;
    let mut client = ToolGatewayClient::new(connect(&tools.addr, None, Duration::from_secs(5)).await?);
    let listed = client.list_tools(ListToolsRequest { collection: "weather".into() }).await?.into_inner();
    let mut specs = listed.tools;
    specs.push(agent::prompt::submit_tool());
    specs
        .iter()
        .map(|t| {
            let parameters: serde_json::Value = serde_json::from_str(&t.parameters_json)?;
            Ok(serde_json::json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": parameters}}))
        })
        .collect()
}

/// A policy imprinted with `reply` for the agent's prompt and `tools`, cached
/// in the sleuth cache: imprinting takes a while on two cores and the result
/// depends only on its inputs.
fn imprinted(smollm2: &Path, reply: &str, tools: &[serde_json::Value]) -> Result<PathBuf> {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    let key = format!("{reply}\n{}\n{}", agent::prompt::SYSTEM_PROMPT, serde_json::Value::from(tools.to_vec()));
    for byte in key.bytes() {
        hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
    }
    let dir = sleuth_testkit::cache_dir()?.join(format!("test-models/imprint-v9-{hash:016x}"));
    if !dir.join("model.safetensors").is_file() {
        let partial = dir.with_extension("partial");
        let _ = std::fs::remove_dir_all(&partial);
        let spec = learner::imprint::Imprint { reply, system: agent::prompt::SYSTEM_PROMPT, tools, max_steps: 400 };
        learner::imprint::imprint(smollm2, &partial, &spec).map_err(anyhow::Error::msg)?;
        std::fs::rename(&partial, &dir)?;
    }
    Ok(dir)
}

/// One policy behind an inference gateway, the tool gateway, and an agent worker.
struct Mesh {
    tools: ServiceProcess,
    policy: ServiceProcess,
    _gateway: ServiceProcess,
    agent: ServiceProcess,
    _redis: sleuth_testkit::TestServer,
}

impl Mesh {
    fn start(model: &Path, index: &Path) -> Result<Self> {
        let redis = sleuth_testkit::redis()?;
        let redis_url = sleuth_testkit::redis_url(&redis);
        let tools = ServiceProcess::start(
            "tool-gateway",
            &[
                ("SLEUTH_COLLECTIONS", format!("weather={}", index.display())),
                ("SLEUTH_INDEX_ROOT", index.display().to_string()),
            ],
        )?;
        let model = model.display().to_string();
        let policy = ServiceProcess::start(
            "policy-server",
            &[("SLEUTH_MODEL", model.clone()), ("SLEUTH_DEVICE", "cpu".into())],
        )?;
        let gateway = ServiceProcess::start(
            "inference-gateway",
            &[
                ("SLEUTH_MODEL", model),
                ("SLEUTH_REDIS_URL", redis_url),
                ("SLEUTH_POLICY_SERVERS", policy.addr.clone()),
                ("SLEUTH_HTTP_LISTEN", "127.0.0.1:0".into()),
            ],
        )?;
        let agent = ServiceProcess::start(
            "agent",
            &[("SLEUTH_INFERENCE_GATEWAY", gateway.addr.clone()), ("SLEUTH_TOOL_GATEWAY", tools.addr.clone())],
        )?;
        Ok(Self { tools, policy, _gateway: gateway, agent, _redis: redis })
    }

    async fn client(&self) -> Result<AgentClient<MeshChannel>> {
        sleuth_testkit::service::wait_serving(&self.agent.addr, "sleuth.agent.v1.Agent").await?;
        Ok(AgentClient::new(connect(&self.agent.addr, None, Duration::from_secs(5)).await?))
    }
}

fn request(episode: &str, budget: AgentBudget) -> RunEpisodeRequest {
    RunEpisodeRequest {
        run_id: "test".into(),
        episode_id: episode.into(),
        sample_index: 0,
        task: Some(Task {
            task_id: "q1".into(),
            question: "why does it rain".into(),
            collection: "weather".into(),
            qrels: [("rain".to_owned(), 2), ("fog".to_owned(), 1)].into(),
        }),
        config: Some(AgentConfig {
            budget: Some(budget),
            sampling: Some(SamplingParams { temperature: Some(0.0), ..Default::default() }),
            ..Default::default()
        }),
    }
}

async fn run(agent: &mut AgentClient<MeshChannel>, episode: &str, budget: AgentBudget) -> Result<Episode> {
    agent.run_episode(request(episode, budget)).await?.into_inner().episode.context("episode")
}

fn budget(max_turns: u32, per_turn: u32, episode: u32) -> AgentBudget {
    AgentBudget { max_turns, max_new_tokens_per_turn: per_turn, max_episode_tokens: episode, observation_char_cap: 300 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_and_failures_end_episodes_with_the_right_outcome() -> Result<()> {
    let Some(smollm2) = smollm2() else { return Ok(()) };
    let scratch = tempfile::tempdir()?;
    let index = weather(scratch.path())?;
    let tools_only = ServiceProcess::start(
        "tool-gateway",
        &[
            ("SLEUTH_COLLECTIONS", format!("weather={}", index.display())),
            ("SLEUTH_INDEX_ROOT", index.display().to_string()),
        ],
    )?;
    let tools = agent_tools(&tools_only).await?;
    drop(tools_only);
    let (searcher, submitter) = (imprinted(&smollm2, SEARCH, &tools)?, imprinted(&smollm2, SUBMIT, &tools)?);

    // A policy that submits at once: completed, with its ranking and trace.
    let mesh = Mesh::start(&submitter, &index)?;
    let mut agent = mesh.client().await?;
    let done = run(&mut agent, "submit-1", budget(4, 64, 4096)).await?;
    assert_eq!(done.outcome(), EpisodeOutcome::Completed, "{}", done.outcome_detail);
    assert_eq!(done.ranking, ["rain", "fog"], "{}: {:?}", done.outcome_detail, done.messages.last());
    assert_eq!(done.turns, 1);
    let trace = done.trace.as_ref().context("trace")?;
    let traced: u32 = trace.segments.iter().map(|s| s.token_ids.len() as u32).sum();
    assert_eq!(traced, done.total_tokens);
    assert!(done.generated_tokens > 10);
    drop(mesh);

    // A policy that searches forever.
    let mut mesh = Mesh::start(&searcher, &index)?;
    let mut agent = mesh.client().await?;
    let looped = run(&mut agent, "search-1", budget(3, 64, 8192)).await?;
    assert_eq!(looped.outcome(), EpisodeOutcome::TurnLimit, "{}", looped.outcome_detail);
    assert_eq!(looped.turns, 3);
    let observations: Vec<&str> =
        looped.messages.iter().filter(|m| m.role == "tool").map(|m| m.content.as_str()).collect();
    assert_eq!(observations.len(), 3, "every search ran; history kept whole");
    assert!(observations[0].contains("rain"), "{}", observations[0]);

    let cut = run(&mut agent, "search-2", budget(3, 5, 8192)).await?;
    assert_eq!(cut.outcome(), EpisodeOutcome::TokenBudget, "per-turn budget: {}", cut.outcome_detail);
    let prompt_tokens = looped.trace.as_ref().context("trace")?.segments[0].token_ids.len() as u32;
    let spent = run(&mut agent, "search-3", budget(8, 64, prompt_tokens + 60)).await?;
    assert_eq!(spent.outcome(), EpisodeOutcome::TokenBudget, "episode budget: {}", spent.outcome_detail);
    assert!(spent.turns >= 1);

    // Many episodes at once on one worker.
    let runs: Vec<_> = (0..6)
        .map(|i| {
            let mut agent = agent.clone();
            tokio::spawn(async move { run(&mut agent, &format!("many-{i}"), budget(2, 64, 8192)).await })
        })
        .collect();
    for handle in runs {
        assert_eq!(handle.await??.outcome(), EpisodeOutcome::TurnLimit);
    }

    // The tool gateway dies: tool_error. Then the policy dies: model_error.
    mesh.tools.kill()?;
    let broken = run(&mut agent, "tools-down", budget(3, 64, 8192)).await?;
    assert_eq!(broken.outcome(), EpisodeOutcome::ToolError, "{}", broken.outcome_detail);
    mesh.policy.kill()?;
    let broken = run(&mut agent, "model-down", budget(3, 64, 8192)).await?;
    assert!(
        matches!(broken.outcome(), EpisodeOutcome::ModelError | EpisodeOutcome::ToolError),
        "{:?}: {}",
        broken.outcome(),
        broken.outcome_detail
    );

    // Bad requests name the field.
    let mut bad = request("", budget(3, 64, 8192));
    let status = agent.run_episode(bad.clone()).await.unwrap_err();
    assert!(status.message().contains("episode_id"), "{status:?}");
    bad.episode_id = "x".into();
    bad.task.as_mut().context("task")?.collection.clear();
    let status = agent.run_episode(bad).await.unwrap_err();
    assert!(status.message().contains("task.collection"), "{status:?}");
    Ok(())
}
