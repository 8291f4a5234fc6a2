"""One GRPO step in plain PyTorch + transformers: the peer of Sleuth's learner
in services/learner/benches/grpo_step.rs. Same model, same batch, same loss
(PPO clipped ratio with dual clip to the behaviour logprobs, token-mean over
the loss mask), global grad-norm clip 1.0, torch.optim.AdamW.

Reads {"model_dir", "samples": [{"tokens", "mask", "behaviour", "advantage"}], "steps": N}
on stdin; writes {"tokens_per_s": ..., "seconds_per_step": ...} (tokens = all
positions of the batch, as the learner counts them).
"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

request = json.load(sys.stdin)
model = AutoModelForCausalLM.from_pretrained(request["model_dir"], dtype=torch.float32)
model.train()
samples = request["samples"]
width = max(len(s["tokens"]) for s in samples) - 1
rows = len(samples)
inputs = torch.zeros(rows, width, dtype=torch.long)
targets = torch.zeros(rows, width, dtype=torch.long)
mask = torch.zeros(rows, width)
behaviour = torch.zeros(rows, width)
attention = torch.zeros(rows, width, dtype=torch.long)
for i, s in enumerate(samples):
    n = len(s["tokens"]) - 1
    inputs[i, :n] = torch.tensor(s["tokens"][:-1])
    targets[i, :n] = torch.tensor(s["tokens"][1:])
    mask[i, :n] = torch.tensor(s["mask"][1:])
    behaviour[i, :n] = torch.tensor(s["behaviour"][1:])
    attention[i, :n] = 1
advantages = torch.tensor([s["advantage"] for s in samples]).unsqueeze(1).expand(rows, width)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)


def step():
    logits = model(input_ids=inputs, attention_mask=attention).logits.float()
    logprobs = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    trainable = mask > 0.5
    ratio = torch.where(trainable, (logprobs - behaviour).exp(), torch.zeros_like(logprobs))
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - 0.2, 1 + 0.28))
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * 3.0), loss)
    loss = torch.where(trainable, loss, torch.zeros_like(loss)).sum() / trainable.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


step()  # warm-up (allocations, optimizer state)
started = time.perf_counter()
for _ in range(request["steps"]):
    step()
seconds = (time.perf_counter() - started) / request["steps"]
tokens = sum(len(s["tokens"]) for s in samples)
print(json.dumps({"tokens_per_s": tokens / seconds, "seconds_per_step": seconds}))
