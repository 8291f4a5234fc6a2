"""Loads an HF directory written by sleuth-model's export with transformers
and prints the logits of fixed token ids as JSON: {"logits": [[...], ...]}.

Usage: export_logits.py MODEL_DIR TOKEN_ID...
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ids = torch.tensor([[int(t) for t in sys.argv[2:]]])
with torch.no_grad():
    logits = model(input_ids=ids).logits[0]
print(json.dumps({"logits": logits.tolist()}))
