//! The Rust model matches transformers' logits for tiny random Llama, Qwen2
//! (sharded checkpoint) and Qwen3 models, with and without the KV cache, at
//! several sequence lengths and on a right-padded batch.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use sleuth_model::{Config, KvCache, Model, load_weights};
use tch::nn::VarStore;
use tch::{Device, Tensor};

const TOLERANCE: f64 = 1e-4;
const BF16_TOLERANCE: f64 = 0.05;

fn golden_models() -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    let script = sleuth_testkit::checkout_file("crates/sleuth-model/tests/make_golden.py");
    let output = Command::new(sleuth_testkit::venv_python()?).arg(script).arg(dir.path()).output()?;
    ensure!(output.status.success(), "make_golden.py failed: {}", String::from_utf8_lossy(&output.stderr));
    Ok(dir)
}

fn load(dir: &Path) -> Result<(Model, VarStore, HashMap<String, Tensor>)> {
    let config = Config::from_file(&dir.join("config.json"))?;
    let mut vars = VarStore::new(Device::Cpu);
    let model = Model::new(&vars.root(), &config);
    load_weights(&mut vars, dir)?;
    let golden = Tensor::read_safetensors(dir.join("golden.safetensors"))?.into_iter().collect();
    Ok((model, vars, golden))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// Full passes, KV-cache decoding and a padded batch against transformers'
/// f32 logits; `kind` is the dtype the model runs in.
fn check_family(root: &Path, family: &str, kind: tch::Kind, tolerance: f64) -> Result<()> {
    let (model, mut vars, golden) = load(&root.join(family))?;
    vars.set_kind(kind);
    let ids = golden.get("input_ids").context("input_ids")?;
    tch::no_grad(|| -> Result<()> {
        for length in [1, 5, 12] {
            let logits = model.forward(&ids.narrow(1, 0, length), None);
            let diff = max_diff(&logits, &golden[&format!("logits_{length}")]);
            ensure!(diff < tolerance, "{family} {kind:?}: full forward, length {length}: max |diff| {diff}");
        }

        // Prefill 5, then a chunk of 4 (several new tokens over a cached prefix), then one at a time.
        let mut cache = KvCache::new(&model.config);
        let mut pieces = vec![model.forward_with_cache(&ids.narrow(1, 0, 5), &mut cache)];
        pieces.push(model.forward_with_cache(&ids.narrow(1, 5, 4), &mut cache));
        for position in 9..12 {
            pieces.push(model.forward_with_cache(&ids.narrow(1, position, 1), &mut cache));
        }
        assert_eq!(cache.len(), 12);
        let cached = Tensor::cat(&pieces, 1);
        let diff = max_diff(&cached, &golden["logits_12"]);
        ensure!(diff < tolerance, "{family} {kind:?}: with KV cache: max |diff| {diff}");

        let mask = &golden["padded_mask"];
        let logits = model.forward(&golden["padded_ids"], Some(mask));
        let real = mask.unsqueeze(-1).to_kind(tch::Kind::Float);
        let diff = max_diff(&(&logits * &real), &(&golden["padded_logits"] * &real));
        ensure!(diff < tolerance, "{family} {kind:?}: right-padded batch: max |diff| {diff}");
        Ok(())
    })
}

#[test]
fn logits_match_transformers_for_llama_qwen2_and_qwen3() -> Result<()> {
    let models = golden_models()?;
    for family in ["llama", "qwen2", "qwen3"] {
        check_family(models.path(), family, tch::Kind::Float, TOLERANCE)?;
    }
    Ok(())
}

/// bf16 weights and activations (the fast CPU path with AVX512-BF16, and the
/// usual GPU dtype) stay close to transformers' f32 logits, on every path:
/// bf16 keeps about 3 significant digits, so the bound is loose but far below
/// the logits' spread (about 1).
#[test]
fn bf16_logits_stay_close_to_transformers_f32() -> Result<()> {
    let models = golden_models()?;
    for family in ["llama", "qwen2", "qwen3"] {
        check_family(models.path(), family, tch::Kind::BFloat16, BF16_TOLERANCE)?;
    }
    Ok(())
}

#[test]
fn a_checkpoint_missing_a_parameter_is_named() -> Result<()> {
    let models = golden_models()?;
    let dir = models.path().join("llama");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    config["tie_word_embeddings"] = serde_json::Value::Bool(false);
    std::fs::write(dir.join("config.json"), config.to_string())?;
    let config = Config::from_file(&dir.join("config.json"))?;
    let mut vars = VarStore::new(Device::Cpu);
    let _model = Model::new(&vars.root(), &config);
    let error = load_weights(&mut vars, &dir).unwrap_err().to_string();
    assert!(error.contains("lm_head.weight"), "{error}");
    Ok(())
}

#[test]
fn unsupported_configs_are_rejected_by_name() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("config.json");
    let base = serde_json::json!({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 16
    });
    for (key, value, needle) in [
        ("model_type", serde_json::json!("gpt2"), "model_type \"gpt2\""),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act \"gelu\""),
        ("rope_scaling", serde_json::json!({"rope_type": "yarn", "factor": 4.0}), "rope scaling"),
        ("num_key_value_heads", serde_json::json!(3), "not a multiple"),
    ] {
        let mut config = base.clone();
        config[key] = value;
        std::fs::write(&path, config.to_string())?;
        let error = Config::from_file(&path).unwrap_err().to_string();
        assert!(error.contains(needle), "{key}: {error}");
    }
    Ok(())
}

/// Continuous batching: sequences of different lengths decoded together give
/// each sequence the logits it gets alone, also across removals and capacity growth.
#[test]
fn batched_decoding_matches_each_sequence_alone() -> Result<()> {
    let models = golden_models()?;
    for family in ["llama", "qwen2", "qwen3"] {
        let (model, _vars, _golden) = load(&models.path().join(family))?;
        tch::no_grad(|| -> Result<()> {
            // Deterministic token streams; one long enough to cross the cache's first capacity step.
            let streams: Vec<Vec<i64>> = [(3usize, 11i64), (7, 5), (254, 3)]
                .iter()
                .map(|&(len, seed)| (0..len as i64 + 6).map(|i| (i * 37 + seed * 101) % 256).collect())
                .collect();
            let prompts = [3usize, 7, 254];
            let alone: Vec<Tensor> = streams
                .iter()
                .map(|s| model.forward(&Tensor::from_slice(s).unsqueeze(0), None).squeeze_dim(0))
                .collect();

            let mut batch = sleuth_model::BatchCache::new(&model.config, 4, tch::Kind::Float, Device::Cpu);
            let mut rows: Vec<usize> = Vec::new(); // rows[r] = stream decoded in row r
            for (stream, &prompt) in prompts.iter().enumerate() {
                let mut cache = KvCache::new(&model.config);
                let _prompt_logits =
                    model.forward_with_cache(&Tensor::from_slice(&streams[stream][..prompt]).unsqueeze(0), &mut cache);
                batch.insert(&cache).map_err(anyhow::Error::msg)?;
                rows.push(stream);
            }
            let mut position: Vec<usize> = prompts.to_vec();
            for step in 0..5 {
                if step == 2 {
                    // The first sequence finishes; the last row moves into its place.
                    batch.remove(0);
                    let moved = rows.pop().expect("rows");
                    rows[0] = moved;
                }
                let tokens: Vec<i64> = rows.iter().map(|&s| streams[s][position[s]]).collect();
                let logits = model.decode_step(&tokens, &mut batch);
                for (row, &stream) in rows.iter().enumerate() {
                    let expected = alone[stream].get(position[stream] as i64);
                    let diff = max_diff(&logits.get(row as i64), &expected);
                    ensure!(diff < TOLERANCE, "{family}: step {step}, stream {stream}: max |diff| {diff}");
                    position[stream] += 1;
                }
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// A cache kept after a sequence leaves the batch, truncated to a shared
/// prefix, continues exactly like a fresh prefill (prefix reuse).
#[test]
fn extracted_and_truncated_caches_continue_like_a_fresh_prefill() -> Result<()> {
    let models = golden_models()?;
    let (model, _vars, golden) = load(&models.path().join("qwen3"))?;
    let ids = golden["input_ids"].get(0);
    tch::no_grad(|| -> Result<()> {
        let mut cache = KvCache::new(&model.config);
        let _ = model.forward_with_cache(&ids.narrow(0, 0, 6).unsqueeze(0), &mut cache);
        let mut batch = sleuth_model::BatchCache::new(&model.config, 2, tch::Kind::Float, Device::Cpu);
        batch.insert(&cache).map_err(anyhow::Error::msg)?;
        let _ = model.decode_step(&[ids.int64_value(&[6])], &mut batch);
        let mut kept = batch.extract(0);
        assert_eq!(kept.len(), 7);
        kept.truncate(5);
        let continued = model.forward_with_cache(&ids.narrow(0, 5, 7).unsqueeze(0), &mut kept);
        let fresh = model.forward(&ids.unsqueeze(0), None).narrow(1, 5, 7);
        let diff = max_diff(&continued, &fresh);
        ensure!(diff < TOLERANCE, "reused prefix: max |diff| {diff}");
        Ok(())
    })
}
