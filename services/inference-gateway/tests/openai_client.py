"""Drives the gateway's OpenAI-compatible endpoint with the official `openai`
client: a tool-calling round trip (the model calls `search`, the client runs
it and sends the result back, the model answers).

Usage: openai_client.py BASE_URL API_KEY  -> prints a JSON summary.
SmolLM2-135M does not call tools from instructions alone, so the history
shows it three worked examples first; greedy decoding then calls the tool.
"""

import json
import sys

from openai import OpenAI

base_url, api_key = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
tools = [{
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the documents for a query.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}]


def example_call(query):
    return '<tool_call>[{"name": "search", "arguments": {"query": "%s"}}]</tool_call>' % query


messages = [{"role": "system", "content": "Answer every request by calling the search tool."}]
for query in ["rainfall in Spain", "vitamin D deficiency", "protein folding"]:
    messages += [
        {"role": "user", "content": f"Find documents about {query}."},
        {"role": "assistant", "content": example_call(query)},
    ]
messages.append({"role": "user", "content": "Find documents about black holes."})

first = client.chat.completions.create(
    model="sleuth-policy", messages=messages, tools=tools, temperature=0, max_tokens=48, logprobs=True
)
choice = first.choices[0]
calls = choice.message.tool_calls or []
summary = {
    "finish_reason": choice.finish_reason,
    "tool_calls": [{"id": c.id, "name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in calls],
    "logprobs": len(choice.logprobs.content) if choice.logprobs else 0,
    "completion_tokens": first.usage.completion_tokens,
}

# The round trip: the client runs the tool and sends its result back.
messages.append(choice.message.model_dump(exclude_none=True))
for call in calls:
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "[d1] Black holes bend light."})
second = client.chat.completions.create(model="sleuth-policy", messages=messages, tools=tools, temperature=0, max_tokens=24)
summary["second"] = {
    "finish_reason": second.choices[0].finish_reason,
    "content": second.choices[0].message.content,
    "cached_tokens": second.usage.prompt_tokens_details.cached_tokens,
}
print(json.dumps(summary))
