//! The GGUF reader and importer against the reference implementations: the
//! `gguf` Python package's dequantisation (bit for bit, every block format),
//! and `transformers` loading the same GGUF files (tensors bit for bit, token
//! ids, and logits through `sleuth-model`).

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use safetensors::SafeTensors;
use sleuth_gguf::{GgufFile, OutputDtype, import_hf_dir};
use sleuth_model::{Config, Model, load_weights};
use tch::nn::VarStore;
use tch::{Device, Tensor};

fn fixtures(mode: &str) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    let script = sleuth_testkit::checkout_file("crates/sleuth-gguf/tests/make_gguf_fixtures.py");
    let output = Command::new(sleuth_testkit::venv_python()?).arg(script).arg(mode).arg(dir.path()).output()?;
    ensure!(
        output.status.success(),
        "make_gguf_fixtures.py {mode} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(dir)
}

fn import(gguf: &Path, out: &Path) -> Result<sleuth_gguf::ImportSummary> {
    Ok(import_hf_dir(gguf, out, OutputDtype::F32, &mut |_, _, _| {})?)
}

/// Asserts every tensor of `ours` (safetensors) equals, byte for byte, the
/// one of the same name in `theirs` (under `prefix`).
fn assert_same_tensors(ours: &Path, theirs: &Path, prefix: &str) -> Result<usize> {
    let (ours_bytes, theirs_bytes) = (std::fs::read(ours)?, std::fs::read(theirs)?);
    let (ours, theirs) = (SafeTensors::deserialize(&ours_bytes)?, SafeTensors::deserialize(&theirs_bytes)?);
    for (name, tensor) in ours.tensors() {
        let reference =
            theirs.tensor(&format!("{prefix}{name}")).with_context(|| format!("{name} not in reference"))?;
        assert_eq!(tensor.shape(), reference.shape(), "{name}: shape");
        assert_eq!(tensor.dtype(), reference.dtype(), "{name}: dtype");
        assert!(tensor.data() == reference.data(), "{name}: values differ from the reference");
    }
    Ok(ours.len())
}

#[test]
fn every_block_format_dequantises_exactly_as_gguf_py() -> Result<()> {
    let dir = fixtures("blocks")?;
    let quants = GgufFile::open(&dir.path().join("quants.gguf"))?;
    let expected = GgufFile::open(&dir.path().join("expected.gguf"))?;
    assert_eq!(quants.tensors.len(), 13, "one tensor per supported type");
    for tensor in &quants.tensors {
        let reference = expected.tensor(&tensor.name).context("expected tensor")?;
        assert_eq!(tensor.shape(), reference.shape(), "{}", tensor.name);
        let (ours, theirs) = (quants.read_f32(tensor)?, expected.read_f32(reference)?);
        let differing = ours.iter().zip(&theirs).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(
            differing,
            0,
            "{} ({}): {differing} of {} values differ",
            tensor.name,
            tensor.ggml_type.name(),
            ours.len()
        );
    }
    Ok(())
}

#[test]
fn llama_qwen2_and_qwen3_ggufs_import_as_transformers_loads_them() -> Result<()> {
    let dir = fixtures("models")?;
    for family in ["llama", "qwen2", "qwen3"] {
        let out = dir.path().join(format!("{family}-hf"));
        let summary = import(&dir.path().join(format!("{family}.gguf")), &out)?;
        assert_eq!(summary.architecture, family);
        let reference = dir.path().join(format!("{family}.reference.safetensors"));
        let tensors = assert_same_tensors(&out.join("model.safetensors"), &reference, "state.")?;
        assert_eq!(tensors, summary.tensors);

        // The written config drives Sleuth's model to transformers' logits.
        let config = Config::from_file(&out.join("config.json"))?;
        let mut vars = VarStore::new(Device::Cpu);
        let model = Model::new(&vars.root(), &config);
        load_weights(&mut vars, &out)?;
        let golden: std::collections::HashMap<String, Tensor> =
            Tensor::read_safetensors(&reference)?.into_iter().collect();
        let logits = tch::no_grad(|| model.forward(&golden["input_ids"], None));
        let diff = (logits - &golden["logits"]).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "{family}: max abs logit difference {diff}");

        // The tokenizer splits text as transformers' does for this pre-tokenizer.
        let tokenizer = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(format!("{family}.tokens.json")))?)?;
        for (text, ids) in expected["texts"].as_array().unwrap().iter().zip(expected["ids"].as_array().unwrap()) {
            let text = text.as_str().unwrap();
            let ours = tokenizer.encode(text, true).map_err(anyhow::Error::msg)?;
            let ids: Vec<u32> = serde_json::from_value(ids.clone())?;
            assert_eq!(ours.get_ids(), &ids[..], "{family}: token ids of {text:?}");
        }
        assert!(out.join("chat_template.jinja").is_file(), "{family}: chat template written");
        eprintln!("{family}: {tensors} tensors bit-identical, logits within {diff:.1e}, tokens identical");
    }
    Ok(())
}

/// The real SmolLM2 (Q4_1 + Q8_0) imports to exactly the checkpoint and
/// tokenizer `make setup` got from transformers, which the policy server's
/// greedy-match test checks against transformers' generation.
#[test]
fn smollm2_imports_to_the_same_checkpoint_as_transformers() -> Result<()> {
    let reference = sleuth_testkit::cache_dir()?.join("models/smollm2-135m-instruct");
    let gguf = sleuth_testkit::smollm2_gguf()?;
    ensure!(reference.join("model.safetensors").is_file(), "{} missing; run `make setup`", reference.display());
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("smollm2");
    let summary = import(&gguf, &out)?;
    assert_eq!(summary.source_types.get("Q4_1"), Some(&210));
    let tensors = assert_same_tensors(&out.join("model.safetensors"), &reference.join("model.safetensors"), "")?;
    assert_eq!(tensors, 272);

    let ours = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    let theirs = tokenizers::Tokenizer::from_file(reference.join("tokenizer.json")).map_err(anyhow::Error::msg)?;
    for text in ["<|im_start|>system\nYou are Sleuth.<|im_end|>\n", "It's 2024: naïve café, 東京 🚀\n\n\tx", "   "]
    {
        let (a, b) = (
            ours.encode(text, true).map_err(anyhow::Error::msg)?,
            theirs.encode(text, true).map_err(anyhow::Error::msg)?,
        );
        assert_eq!(a.get_ids(), b.get_ids(), "{text:?}");
    }
    let template = |dir: &Path| std::fs::read_to_string(dir.join("chat_template.jinja"));
    assert_eq!(template(&out)?, template(&reference)?);
    let config = |dir: &Path| -> Result<serde_json::Value> {
        Ok(serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?)
    };
    let (ours, theirs) = (config(&out)?, config(&reference)?);
    for key in [
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ] {
        assert_eq!(ours[key], theirs[key], "config.json {key}");
    }
    assert_eq!(ours["rope_parameters"]["rope_theta"], theirs["rope_parameters"]["rope_theta"]);
    Ok(())
}

#[test]
fn bad_files_get_errors_that_name_the_problem() -> Result<()> {
    let dir = fixtures("blocks")?;
    let error = |path: &Path| import(path, &dir.path().join("out")).unwrap_err().to_string();

    let not_gguf = dir.path().join("weights.bin");
    std::fs::write(&not_gguf, b"PK\x03\x04 a zip file")?;
    let message = error(&not_gguf);
    assert!(message.contains("not a GGUF file") && message.contains("magic"), "{message}");

    let quants = std::fs::read(dir.path().join("quants.gguf"))?;
    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &quants[..quants.len() - 100])?;
    let message = error(&truncated);
    assert!(message.contains("runs past the end of the file"), "{message}");
    std::fs::write(&truncated, &quants[..40])?;
    let message = error(&truncated);
    assert!(message.contains("file ends inside the header"), "{message}");

    // A valid file of an architecture the model crate does not implement.
    let message = error(&dir.path().join("quants.gguf"));
    assert!(message.contains("general.architecture") && message.contains("\"test\""), "{message}");

    std::fs::create_dir(dir.path().join("existing"))?;
    let message = import(&dir.path().join("quants.gguf"), &dir.path().join("existing")).unwrap_err().to_string();
    assert!(message.contains("already exists"), "{message}");
    assert!(!dir.path().join("out").exists() && !dir.path().join("out.partial").exists(), "nothing half-written");
    Ok(())
}
