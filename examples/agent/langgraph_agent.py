"""The same agent written with LangGraph, as many users write theirs: a
ReAct loop (the model calls the lookup tool, then answers) over
langchain-openai's ChatOpenAI, pointed at the item's address at the run's
gateway. The last message of the graph is the answer.

Run once per item (langgraph.yaml), the item comes as JSON on standard
input and the address in OPENAI_BASE_URL / OPENAI_API_KEY. Served
(langgraph-server.yaml: `python3 -m evalfleet_agent langgraph_agent.py
solve`), one process imports LangGraph once and `solve` answers every item,
each with its own address (`client.base_url`, `client.api_key`).
"""

import json
import os
import sys

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima",
    "Canada": "Ottawa", "Norway": "Oslo", "Egypt": "Cairo", "Chile": "Santiago",
    "Vietnam": "Hanoi", "Australia": "Canberra", "Morocco": "Rabat",
}


@tool
def lookup(country: str) -> str:
    """The capital of a country, from an atlas."""
    return CAPITALS.get(country, "no entry for " + country)


def answer(item, base_url, api_key):
    model = ChatOpenAI(
        model="agent-model",
        base_url=base_url,
        api_key=api_key,
        temperature=0,
    )
    agent = create_react_agent(model, [lookup])
    result = agent.invoke({"messages": [("user", item["question"])]})
    return result["messages"][-1].content


def solve(item, client):
    """One item, for evalfleet's helper (task.mode: server)."""
    return answer(item, str(client.base_url), client.api_key)


def main():
    item = json.load(sys.stdin)
    print(answer(item, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]))


if __name__ == "__main__":
    main()
