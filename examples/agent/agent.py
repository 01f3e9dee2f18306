"""A small agent, written as users write them: the official `openai` SDK,
one tool, three model calls per question.

evalfleet runs it once per item (`kind: exec`), with the item as JSON on
its standard input and OPENAI_BASE_URL / OPENAI_API_KEY set to the item's
address at the run's gateway; whatever it prints is its answer.
"""

import json
import sys

from openai import OpenAI

# The agent's own "database": what its tool looks up.
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


def lookup(country):
    return CAPITALS.get(country, "no entry for " + country)


def solve(item, client):
    """The agent on one item, with `client` at the item's address: run once
    per item (main, below), or served by evalfleet's helper
    (`python3 -m evalfleet_agent agent.py solve`, task.mode: server)."""
    messages = [
        {"role": "system", "content": "Answer questions about countries. Use the lookup tool."},
        {"role": "user", "content": item["question"]},
    ]
    # 1. The model asks for the tool.
    first = client.chat.completions.create(model="agent-model", messages=messages, tools=TOOLS)
    reply = first.choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    for call in reply.tool_calls or []:
        arguments = json.loads(call.function.arguments or "{}")
        messages.append({
            "role": "tool",
            "tool_call_id": call.id,
            "content": lookup(arguments.get("country", "")),
        })
    # 2. It answers with the tool's result (streamed, as chat UIs do).
    text = ""
    stream = client.chat.completions.create(
        model="agent-model", messages=messages, tools=TOOLS, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    messages.append({"role": "assistant", "content": text})
    # 3. It is asked for the answer alone.
    messages.append({"role": "user", "content": "Reply with the capital's name alone."})
    last = client.chat.completions.create(model="agent-model", messages=messages)
    return last.choices[0].message.content.strip()


def main():
    item = json.load(sys.stdin)
    # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment.
    print(solve(item, OpenAI()))


if __name__ == "__main__":
    main()
