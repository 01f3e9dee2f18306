"""The same agent written with LangGraph, as many users write theirs: a
ReAct loop (the model calls the lookup tool, then answers) over
langchain-openai's ChatOpenAI, pointed at the item's address at the run's
gateway (OPENAI_BASE_URL, OPENAI_API_KEY). The item comes as JSON on
standard input; the last message of the graph is the answer.
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


def main():
    item = json.load(sys.stdin)
    model = ChatOpenAI(
        model="agent-model",
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
        temperature=0,
    )
    agent = create_react_agent(model, [lookup])
    result = agent.invoke({"messages": [("user", item["question"])]})
    print(result["messages"][-1].content)


if __name__ == "__main__":
    main()
