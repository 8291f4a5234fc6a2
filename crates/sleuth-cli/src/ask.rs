//! `sleuth ask`: one question to the policy server, rendered with the model's
//! own chat template and tokenizer, answered greedily.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use sleuth_chat::ChatTemplate;
use sleuth_kit::BearerToken;
use sleuth_proto::common::v1::SamplingParams;
use sleuth_proto::policy::v1::GenerateRequest;
use sleuth_proto::policy::v1::policy_server_client::PolicyServerClient;

#[derive(clap::Args, Debug)]
pub struct AskArgs {
    /// Policy server address.
    #[arg(long, env = "SLEUTH_POLICY_SERVER", default_value = "127.0.0.1:50055")]
    policy_server: String,
    /// The served model's directory (for its chat template and tokenizer).
    #[arg(long, env = "SLEUTH_MODEL")]
    model: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: u32,
    #[arg(long, env = "SLEUTH_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<BearerToken>,
    /// The question.
    question: String,
}

pub async fn run(args: AskArgs) -> anyhow::Result<()> {
    let dir = args.model.unwrap_or_else(sleuth_kit::config::default_model_dir);
    let template = ChatTemplate::from_dir(&dir)?;
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    let messages = [serde_json::json!({"role": "user", "content": args.question})];
    let prompt = template.render(&messages, &[], true)?;
    let ids =
        tokenizer.encode(prompt.as_str(), false).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?.get_ids().to_vec();

    let channel =
        sleuth_kit::client::connect(&args.policy_server, args.auth_token.as_ref(), Duration::from_secs(5)).await?;
    let request = GenerateRequest {
        request_id: String::new(),
        session_id: String::new(),
        prompt_token_ids: ids.clone(),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            max_new_tokens: args.max_new_tokens,
            ..Default::default()
        }),
        return_model_logprobs: true,
        min_policy_version: 0,
        run_id: String::new(),
    };
    let started = Instant::now();
    let response = sleuth_kit::sized!(PolicyServerClient::new(channel))
        .generate(request)
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?;
    let response = response.into_inner();
    let answer = tokenizer.decode(&response.token_ids, true).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    println!("{}", answer.trim());
    let mean_logprob = response.model_logprobs.iter().sum::<f32>() / response.model_logprobs.len().max(1) as f32;
    println!(
        "({} prompt tokens, {} generated in {:.2} s, policy version {}, mean token logprob {mean_logprob:.3})",
        ids.len(),
        response.token_ids.len(),
        started.elapsed().as_secs_f64(),
        response.policy_versions.last().copied().unwrap_or(0)
    );
    Ok(())
}
