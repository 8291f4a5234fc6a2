//! A few GRPO steps teach a tiny random policy a verifiable toy task: the
//! reward of an episode is the fraction of its 8 sampled tokens that are
//! token 7 (1 in 16 at the start). Sampling, behaviour logprobs, groups,
//! advantages, the PPO loss and AdamW all take their real paths.
//!
//! A fresh policy for a collection (`learner init-policy`) is an HF model
//! that transformers loads, with a tokenizer of the collection's own text.

use anyhow::Result;
use learner::advantage::Estimator;
use learner::batch::samples;
use learner::loss::{Aggregation, LossConfig, PolicyLoss};
use learner::shard::AdamW;
use learner::trainer::{Objective, Trainer, TrainerConfig};
use sleuth_c10d::Single;
use sleuth_model::sampling::{Rng, Sampling, sample};
use sleuth_model::{Config, Model};
use sleuth_proto::common::v1::{Episode, SegmentKind, Trace, TraceSegment, TrajectoryGroup};
use tch::nn::VarStore;
use tch::{Device, Tensor};

const TARGET: u32 = 7;
const NEW_TOKENS: usize = 8;
const GROUP: usize = 8;
const PROMPTS: [[u32; 3]; 4] = [[1, 2, 3], [4, 5, 6], [2, 9, 4], [11, 3, 8]];
const STEPS: usize = 12;

/// An episode of `model` after `prompt`, sampled at `temperature`, with its
/// behaviour logprobs and temperature recorded as the inference gateway does.
fn episode(model: &Model, prompt: &[u32], rng: &mut Rng, temperature: f32) -> Episode {
    let sampling = Sampling { temperature, ..Sampling::default() };
    let mut tokens: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).collect();
    let (mut sampled, mut logprobs) = (Vec::new(), Vec::new());
    tch::no_grad(|| {
        for _ in 0..NEW_TOKENS {
            let logits = model.forward(&Tensor::from_slice(&tokens).unsqueeze(0), None);
            let next = sample(&logits.get(0).get(-1), &sampling, rng);
            sampled.push(next.token);
            logprobs.push(next.logprob);
            tokens.push(i64::from(next.token));
        }
    });
    let hits = sampled.iter().filter(|&&t| t == TARGET).count();
    Episode {
        reward: hits as f64 / NEW_TOKENS as f64,
        trace: Some(Trace {
            segments: vec![
                TraceSegment {
                    kind: SegmentKind::Prompt as i32,
                    token_ids: prompt.to_vec(),
                    loss_mask: vec![0; prompt.len()],
                    ..Default::default()
                },
                TraceSegment {
                    kind: SegmentKind::Policy as i32,
                    loss_mask: vec![1; sampled.len()],
                    token_ids: sampled,
                    logprobs,
                    temperature,
                    ..Default::default()
                },
            ],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A tiny random policy (vocabulary 16) with small weights.
fn tiny_policy() -> Result<(VarStore, Model)> {
    let config: Config = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": true
    }))?;
    let vars = VarStore::new(Device::Cpu);
    let model = Model::new(&vars.root(), &config);
    tch::no_grad(|| {
        for (name, mut var) in vars.variables() {
            if !name.ends_with("norm.weight") {
                var.copy_(&(var.randn_like() * 0.02));
            }
        }
    });
    Ok((vars, model))
}

fn grpo_config(lr: f64) -> TrainerConfig {
    TrainerConfig {
        objective: Objective::Rl(LossConfig {
            policy: PolicyLoss::PPO,
            aggregation: Aggregation::TokenMean,
            tis_cap: None,
            kl_coef: 0.0,
        }),
        optimizer: AdamW { lr, ..AdamW::default() },
        max_grad_norm: 1.0,
        micro_batch: 8,
    }
}

/// The samples of `groups` that have an advantage.
fn trainable(groups: &[TrajectoryGroup]) -> Result<Vec<learner::batch::Sample>> {
    Ok(groups
        .iter()
        .filter_map(|g| samples(g, Estimator::Grpo).transpose())
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .flatten()
        .collect())
}

#[test]
fn grpo_raises_the_reward_of_a_tiny_policy() -> Result<()> {
    tch::manual_seed(11);
    let (vars, model) = tiny_policy()?;
    let mut trainer = Trainer::new(vars, model, None, grpo_config(2e-2), Box::new(Single));
    let mut rng = Rng::new(5);
    let mut curve = Vec::new();
    for step in 0..STEPS {
        let groups: Vec<TrajectoryGroup> = PROMPTS
            .iter()
            .enumerate()
            .map(|(i, prompt)| TrajectoryGroup {
                group_id: format!("{step}-{i}"),
                episodes: (0..GROUP).map(|_| episode(&trainer.model, prompt, &mut rng, 1.0)).collect(),
                ..Default::default()
            })
            .collect();
        let rewards: Vec<f64> = groups.iter().flat_map(|g| g.episodes.iter().map(|e| e.reward)).collect();
        curve.push(rewards.iter().sum::<f64>() / rewards.len() as f64);
        let batch = trainable(&groups)?;
        if !batch.is_empty() {
            trainer.step(&batch)?;
        }
    }
    let curve_text: Vec<String> = curve.iter().map(|r| format!("{r:.3}")).collect();
    println!("mean reward per step: {}", curve_text.join(" "));
    let start = curve[..2].iter().sum::<f64>() / 2.0;
    let end = curve[STEPS - 2..].iter().sum::<f64>() / 2.0;
    assert!(end > start + 0.25, "reward went from {start:.3} to {end:.3}: {curve_text:?}");
    Ok(())
}

/// Episodes sampled at temperature 0.5 are scored at 0.5: before the first
/// update the learner's logprobs equal the sampler's, so the importance
/// ratio is 1 and the train/inference mismatch 0 (scored at temperature 1,
/// the ratio would measure the temperature instead of a change of policy).
#[test]
fn sampled_tokens_are_scored_at_the_temperature_they_were_sampled_at() -> Result<()> {
    tch::manual_seed(3);
    let (vars, model) = tiny_policy()?;
    let mut trainer = Trainer::new(vars, model, None, grpo_config(1e-3), Box::new(Single));
    let mut rng = Rng::new(9);
    let groups: Vec<TrajectoryGroup> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, prompt)| TrajectoryGroup {
            group_id: format!("cold-{i}"),
            episodes: (0..GROUP).map(|_| episode(&trainer.model, prompt, &mut rng, 0.5)).collect(),
            ..Default::default()
        })
        .collect();
    let batch = trainable(&groups)?;
    assert!(batch.iter().all(|s| s.temperature == 0.5), "the trace's temperature reaches the sample");
    let stats = trainer.step(&batch)?;
    println!("ratio mean {:.6}, max {:.6}, mismatch {:.6}", stats.ratio_mean, stats.ratio_max, stats.logprob_mismatch);
    // f32 logits through two paths (one position at a time when sampling,
    // the whole sequence when training) agree to about 1e-6 per token.
    assert!(stats.logprob_mismatch < 1e-4, "mismatch {} at the sampling temperature", stats.logprob_mismatch);
    assert!((stats.ratio_mean - 1.0).abs() < 1e-4, "ratio mean {}", stats.ratio_mean);
    Ok(())
}

#[test]
fn trajectory_sft_fits_teacher_trajectories_on_assistant_tokens_only() -> Result<()> {
    tch::manual_seed(12);
    let config: Config = serde_json::from_value(serde_json::json!({
        "model_type": "llama", "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "tie_word_embeddings": true
    }))?;
    let vars = VarStore::new(Device::Cpu);
    let model = Model::new(&vars.root(), &config);
    let trainer_config = TrainerConfig {
        objective: Objective::Sft(Aggregation::TokenMean),
        optimizer: AdamW { lr: 1e-2, ..AdamW::default() },
        max_grad_norm: 1.0,
        micro_batch: 4,
    };
    let mut trainer = Trainer::new(vars, model, None, trainer_config, Box::new(Single));
    // Teacher: after the prompt, always 7 7 7 7; the prompt itself (mask 0) is noise.
    let teacher: Vec<learner::batch::Sample> = PROMPTS
        .iter()
        .map(|prompt| {
            let tokens: Vec<i64> = prompt.iter().map(|&t| i64::from(t)).chain([7, 7, 7, 7]).collect();
            let (mask, behaviour) = ([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0].to_vec(), vec![0.0; tokens.len()]);
            learner::batch::Sample::unsampled(tokens, mask, behaviour, 0.0)
        })
        .collect();
    assert_eq!(learner::batch::check_sft_mask(&teacher), Ok(4.0 / 6.0));
    let losses: Vec<f64> = (0..15).map(|_| trainer.step(&teacher).map(|s| s.loss)).collect::<Result<_, _>>()?;
    println!("SFT loss per step: {losses:.3?}");
    assert!(losses[14] < losses[0] * 0.3, "SFT loss fell from {:.3} to {:.3}", losses[0], losses[14]);
    Ok(())
}

/// `learner init-policy` makes an HF model of a few million parameters
/// whose tokenizer was trained on the collection: transformers loads it to
/// the same logits as the learner, its chat template renders a search
/// conversation that the tokenizer spells and decodes back exactly, and a
/// forward pass over that conversation costs a small fraction of
/// SmolLM2-135M's (what makes it trainable on two cores).
#[test]
fn a_fresh_policy_has_a_tokenizer_of_its_collection_and_loads_in_transformers() -> anyhow::Result<()> {
    use anyhow::Context;
    let scratch = tempfile::tempdir()?;
    let collection = scratch.path().join("synth");
    sleuth_beir::synth::write(
        &collection,
        sleuth_beir::synth::SynthSpec { family: Default::default(), seed: 5, size: 40 },
    )?;
    // Through the command line, as a user makes one, with a short copy pre-training.
    let out = scratch.path().join("policy");
    let init_policy = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_learner"))
            .args(["init-policy", "--vocab-size", "400", "--hidden-size", "128", "--layers", "2", "--seed", "3"])
            .args(["--copy-steps", "16", "--copy-batch", "8", "--collection"])
            .args([&collection, &out])
            .env_remove("SLEUTH_RUN_ID")
            .output()
    };
    let made = init_policy()?;
    let report = String::from_utf8_lossy(&made.stdout);
    eprintln!("{report}{}", String::from_utf8_lossy(&made.stderr));
    assert!(made.status.success(), "init-policy failed");
    let parameters: i64 = report
        .split_once(": ")
        .and_then(|(_, rest)| rest.split_once(" parameters"))
        .context("the parameter count")?
        .0
        .parse()?;
    assert!(parameters < 1_000_000, "{parameters} parameters");
    assert!(report.contains("a vocabulary of 400 tokens"), "{report}");
    // Copy pre-training learnt: the loss on conversations over held-out documents fell.
    let after_word = |word: &str| -> anyhow::Result<f64> {
        let rest = report.split_once(word).with_context(|| format!("{word:?} in the report"))?.1;
        Ok(rest.split([',', ' ', ')']).next().unwrap_or_default().parse()?)
    };
    let (start, end) = (after_word("(at start ")?, after_word("held-out loss ")?);
    assert!(end < start * 0.7, "held-out loss fell from {start:.3} to {end:.3}");
    let again = init_policy()?;
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("exists"), "{again:?}");
    let fresh_dir = out;

    // Copy rehearsal draws the same kind of conversations over the collection
    // for every SFT step: the same for a step whenever it is trained again
    // (a resumed learner), others at the next, each teaching the writing of
    // one tool call.
    let rehearsal = |per_step: usize, tools: &[&str]| {
        learner::copying::Rehearsal::new(
            &fresh_dir,
            &learner::copying::RehearsalSpec {
                per_step,
                collection: collection.clone(),
                split: "train".into(),
                tools: tools.iter().map(|t| (*t).to_owned()).collect(),
                seed: 9,
            },
        )
    };
    let reply_tokenizer =
        tokenizers::Tokenizer::from_file(fresh_dir.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    let taught = |sample: &learner::batch::Sample| -> anyhow::Result<String> {
        let taught: Vec<u32> =
            sample.tokens.iter().zip(&sample.mask).filter(|(_, m)| **m > 0.0).map(|(t, _)| *t as u32).collect();
        reply_tokenizer.decode(&taught, false).map_err(anyhow::Error::msg)
    };
    let searching = rehearsal(6, &["bm25_search"])?;
    let (first, again, next) = (searching.samples(1)?, searching.samples(1)?, searching.samples(2)?);
    assert_eq!(first.len(), 6);
    assert_eq!(
        first.iter().map(|s| &s.tokens).collect::<Vec<_>>(),
        again.iter().map(|s| &s.tokens).collect::<Vec<_>>()
    );
    assert_ne!(first.iter().map(|s| &s.tokens).collect::<Vec<_>>(), next.iter().map(|s| &s.tokens).collect::<Vec<_>>());
    for sample in &first {
        let reply = taught(sample)?;
        // What to write, never which tool: that is the episodes' to teach.
        assert!(reply.contains("\"arguments\"") && reply.contains("</tool_call>"), "{reply}");
        assert!(!reply.contains("<tool_call>") && !reply.contains("_search") && !reply.contains("submit"), "{reply}");
    }
    // Nor which lead to follow: a rehearsed `follow_lead` call teaches
    // nothing of its own (rehearsing its number taught one lead whatever the
    // questions needed).
    let mut followed = 0;
    for sample in rehearsal(12, &["bm25_search", "follow_lead"])?.samples(1)? {
        let reply = taught(&sample)?;
        assert!(!reply.contains("\"n\"") && !reply.contains("follow_lead"), "{reply}");
        followed += usize::from(!reply.contains("\"arguments\""));
    }
    assert!(followed > 0, "no rehearsed conversation followed a lead");
    let error = learner::copying::Rehearsal::new(
        &fresh_dir,
        &learner::copying::RehearsalSpec {
            per_step: 1,
            collection: scratch.path().join("missing"),
            split: "train".into(),
            tools: vec!["bm25_search".into()],
            seed: 9,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("spec.train.source_uri") && error.contains("missing"), "{error}");

    let config = sleuth_model::Config::from_file(&fresh_dir.join("config.json"))?;
    let mut vars = VarStore::new(Device::Cpu);
    let model = sleuth_model::Model::new(&vars.root(), &config);
    sleuth_model::load_weights(&mut vars, &fresh_dir)?;
    let ids = [1i64, 50, 300, 399, 2];
    let ours = tch::no_grad(|| model.forward(&Tensor::from_slice(&ids).unsqueeze(0), None)).squeeze_dim(0);
    let script = sleuth_testkit::checkout_file("crates/sleuth-model/tests/export_logits.py");
    let args: Vec<String> =
        std::iter::once(fresh_dir.display().to_string()).chain(ids.iter().map(i64::to_string)).collect();
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
    let reference = sleuth_testkit::run_python_json(&script, &args, None)?;
    let rows: Vec<Vec<f32>> = serde_json::from_value(reference["logits"].clone())?;
    let diff = (ours - Tensor::from_slice2(&rows)).abs().max().double_value(&[]);
    assert!(diff < 1e-4, "transformers' logits differ by {diff}");

    // A search conversation over the collection, as the gateway renders it.
    let document = sleuth_beir::BeirDir::new(&collection)
        .corpus(sleuth_beir::BadLines::Fail)?
        .find_map(|d| d.ok().filter(|d| d.text.contains(" lives in ")))
        .context("a person's document")?;
    let call = |name: &str, arguments: serde_json::Value| {
        serde_json::json!({"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments.to_string()}}]})
    };
    let messages = [
        serde_json::json!({"role": "user", "content": format!("Which town is home to {}?", document.title)}),
        call("bm25_search", serde_json::json!({"query": document.title, "k": 5})),
        serde_json::json!({"role": "tool", "content": format!("bm25_search results for {:?}:\n[1] doc_id: {} | {}\n{}\n", document.title, document.id, document.title, document.text)}),
        call("submit_ranking", serde_json::json!({"doc_ids": [document.id]})),
    ];
    let tools = [
        serde_json::json!({"type": "function", "function": {"name": "bm25_search", "description": "Search the collection.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}}}}}),
    ];
    let template = sleuth_chat::ChatTemplate::from_dir(&fresh_dir)?;
    let text = template.render(&messages, &tools, false)?;
    let tokenizer = tokenizers::Tokenizer::from_file(fresh_dir.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    let encoding = tokenizer.encode(text.as_str(), false).map_err(anyhow::Error::msg)?;
    let decoded = tokenizer.decode(encoding.get_ids(), false).map_err(anyhow::Error::msg)?;
    assert_eq!(decoded, text, "the tokenizer spells the conversation back exactly");
    // The tool-call tags and the tools' names are one token each: choosing a tool is one choice.
    for whole in ["<tool_call>", "</tool_call>", "bm25_search", "submit_ranking"] {
        let id = tokenizer.token_to_id(whole).with_context(|| format!("{whole:?} is not a token"))?;
        assert!(encoding.get_ids().contains(&id), "{whole:?} is not spelt as its token in {text}");
    }
    assert!(text.starts_with("<|im_start|>system\n"), "{text}");
    let smollm2 = tokenizers::Tokenizer::from_file(sleuth_testkit::smollm2()?.join("tokenizer.json"))
        .map_err(anyhow::Error::msg)?;
    let theirs = smollm2.encode(text.as_str(), false).map_err(anyhow::Error::msg)?.len();
    // Multiply-adds of a forward pass: about parameters x tokens.
    let ours = parameters as f64 * encoding.len() as f64;
    let smollm2_cost = 134_515_008.0 * theirs as f64;
    eprintln!(
        "the conversation is {} tokens here, {theirs} with SmolLM2's tokenizer; a forward pass costs {:.4} of SmolLM2-135M's",
        encoding.len(),
        ours / smollm2_cost
    );
    assert!(ours < smollm2_cost / 50.0, "{ours} against {smollm2_cost}");
    Ok(())
}
