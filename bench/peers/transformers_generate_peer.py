"""transformers generate() throughput: the peer of Sleuth's policy server in
services/policy-server/benches/generation.rs.

Reads {"model_dir", "dtypes": ["float32", "bfloat16"], "prompt": [ids], "batches": [1, 8, 32],
"new_tokens": N, "prefill_tokens": [ids]} on stdin; writes, per dtype, decode tokens/s per
batch size (greedy, exactly N new tokens per sequence) and prefill tokens/s (one forward
pass over prefill_tokens).
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

request = json.load(sys.stdin)
prompt = torch.tensor([request["prompt"]])
n = request["new_tokens"]
results = {}
for dtype in request["dtypes"]:
    model = AutoModelForCausalLM.from_pretrained(request["model_dir"], dtype=getattr(torch, dtype)).eval()
    decode = {}
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        for batch in request["batches"]:
            ids = prompt.repeat(batch, 1)
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            seconds = time.perf_counter() - started
            decode[str(batch)] = (out.shape[1] - ids.shape[1]) * batch / seconds
        long = torch.tensor([request["prefill_tokens"]])
        model(long)
        started = time.perf_counter()
        model(long)
        prefill = long.shape[1] / (time.perf_counter() - started)
    results[dtype] = {"decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill}
print(json.dumps(results))
