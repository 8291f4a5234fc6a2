"""Greedy continuation of a fixed chat prompt with transformers, as JSON token ids.

usage: smollm2_greedy.py MODEL_DIR MAX_NEW_TOKENS
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

model_dir, max_new_tokens = sys.argv[1], int(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
messages = [{"role": "user", "content": "What is the capital of France?"}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
with torch.no_grad():
    output = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False)
prompt_ids = prompt["input_ids"][0].tolist()
generated = output[0][len(prompt_ids):].tolist()
print(json.dumps({"prompt": prompt_ids, "generated": generated, "text": tokenizer.decode(generated), "eos": tokenizer.eos_token_id}))
