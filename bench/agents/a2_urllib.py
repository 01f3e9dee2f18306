"""A2's cheap agent: the three calls of examples/agent/agent.py (a tool
call, a streamed answer with the tool's result, then the answer alone)
made with the standard library's urllib instead of the openai SDK, so
that the process starts in tens of milliseconds rather than hundreds.

evalfleet runs it once per item (`kind: exec`): the item as JSON on its
standard input, OPENAI_BASE_URL / OPENAI_API_KEY set to the item's
address at the run's gateway; what it prints is its answer.
"""

import json
import os
import sys
import urllib.request

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima",
    "Canada": "Ottawa", "Norway": "Oslo", "Egypt": "Cairo", "Chile": "Santiago",
    "Vietnam": "Hanoi", "Australia": "Canberra", "Morocco": "Rabat",
}

TOOLS = [{
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The capital of a country, from an atlas.",
        "parameters": {
            "type": "object",
            "properties": {"country": {"type": "string"}},
            "required": ["country"],
        },
    },
}]

BASE = os.environ["OPENAI_BASE_URL"].rstrip("/")
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "")}


def post(body):
    request = urllib.request.Request(BASE + "/chat/completions", data=json.dumps(body).encode(), headers=HEADERS)
    return urllib.request.urlopen(request, timeout=120)


def main():
    item = json.load(sys.stdin)
    messages = [
        {"role": "system", "content": "Answer questions about countries. Use the lookup tool."},
        {"role": "user", "content": item["question"]},
    ]
    # 1. The model asks for the tool.
    with post({"model": "agent-model", "messages": messages, "tools": TOOLS}) as r:
        reply = json.load(r)["choices"][0]["message"]
    messages.append({k: v for k, v in reply.items() if v is not None})
    for call in reply.get("tool_calls") or []:
        arguments = json.loads(call["function"].get("arguments") or "{}")
        country = arguments.get("country", "")
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": CAPITALS.get(country, "no entry for " + country)})
    # 2. It answers with the tool's result, streamed.
    text = ""
    with post({"model": "agent-model", "messages": messages, "tools": TOOLS, "stream": True}) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                text += chunk["choices"][0]["delta"]["content"]
    messages.append({"role": "assistant", "content": text})
    # 3. It is asked for the answer alone.
    messages.append({"role": "user", "content": "Reply with the capital's name alone."})
    with post({"model": "agent-model", "messages": messages}) as r:
        print(json.load(r)["choices"][0]["message"]["content"].strip())


if __name__ == "__main__":
    main()
