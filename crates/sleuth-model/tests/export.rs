//! A model written by `export` is an HF directory that transformers loads to
//! the same logits as this crate: what the learner's merged checkpoints and
//! the tests' tiny random policies rely on.

use anyhow::Result;
use sleuth_model::export::{TinyShape, write_random_llama};
use sleuth_model::{Config, Model, load_weights};
use tch::nn::VarStore;
use tch::{Device, Tensor};

#[test]
fn a_written_model_loads_in_transformers_with_the_same_logits() -> Result<()> {
    let smollm2 = sleuth_testkit::smollm2()?;
    let dir = tempfile::tempdir()?;
    write_random_llama(&smollm2, dir.path(), TinyShape::default(), 7)?;
    for file in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        assert!(dir.path().join(file).is_file(), "{file} written");
    }

    let config = Config::from_file(&dir.path().join("config.json"))?;
    let mut vars = VarStore::new(Device::Cpu);
    let model = Model::new(&vars.root(), &config);
    load_weights(&mut vars, dir.path())?;
    let ids = [1i64, 504, 3458, 314, 2];
    let ours = tch::no_grad(|| model.forward(&Tensor::from_slice(&ids).unsqueeze(0), None)).squeeze_dim(0);

    let script = sleuth_testkit::checkout_file("crates/sleuth-model/tests/export_logits.py");
    let args: Vec<String> =
        std::iter::once(dir.path().display().to_string()).chain(ids.iter().map(i64::to_string)).collect();
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_ref()).collect();
    let reference = sleuth_testkit::run_python_json(&script, &args, None)?;
    let rows: Vec<Vec<f32>> = serde_json::from_value(reference["logits"].clone())?;
    let theirs = Tensor::from_slice2(&rows);
    let diff = (ours - theirs).abs().max().double_value(&[]);
    assert!(diff < 1e-4, "max abs logit difference {diff}");
    Ok(())
}
