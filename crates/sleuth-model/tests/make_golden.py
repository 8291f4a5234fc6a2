"""Tiny random Llama, Qwen2 and Qwen3 models with transformers, and their logits
on fixed inputs: the reference the Rust model is tested against.

usage: make_golden.py OUT_DIR
Writes OUT_DIR/<family>/ (config.json, safetensors; qwen2 sharded) and
OUT_DIR/<family>/golden.safetensors with input_ids, logits_<L> for L in 1, 5, 12,
and a right-padded batch (padded_ids, padded_mask, padded_logits).
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

out = Path(sys.argv[1])
common = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
families = {
    # SmolLM2-like: tied embeddings.
    "llama": LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True),
    # Qwen2: q/k/v bias, untied head, large rope theta; saved in shards.
    "qwen2": Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    # Qwen3: q/k norm and a head_dim that is not hidden/heads.
    "qwen3": Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
}
for name, config in families.items():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        # Random everything (norm weights around 1) so every parameter matters.
        for param_name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in param_name else 0.0))
    directory = out / name
    model.save_pretrained(directory, max_shard_size="60KB" if name == "qwen2" else "1GB")
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 12), generator=generator)
    tensors = {"input_ids": ids}
    with torch.no_grad():
        for length in (1, 5, 12):
            tensors[f"logits_{length}"] = model(input_ids=ids[:, :length]).logits.contiguous()
        mask = torch.ones_like(ids)
        mask[1, 7:] = 0
        padded = ids.clone()
        padded[1, 7:] = 0
        tensors["padded_ids"] = padded
        tensors["padded_mask"] = mask
        tensors["padded_logits"] = model(input_ids=padded, attention_mask=mask).logits.contiguous()
    save_file(tensors, str(directory / "golden.safetensors"))
print("ok")
