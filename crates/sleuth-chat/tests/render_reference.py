"""Chat templates rendered by transformers' apply_chat_template, with the token
ids its tokenizer gives, as JSON: the reference for the Rust renderer.

usage: render_reference.py < {"cases": [{"dir", "messages", "tools", "add_generation_prompt"}]}
"""
import json
import sys

from transformers import AutoTokenizer

request = json.load(sys.stdin)
out = []
for case in request["cases"]:
    tokenizer = AutoTokenizer.from_pretrained(case["dir"])
    text = tokenizer.apply_chat_template(
        case["messages"],
        tools=case["tools"] or None,
        tokenize=False,
        add_generation_prompt=case["add_generation_prompt"],
    )
    out.append({"text": text, "ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
print(json.dumps(out))
