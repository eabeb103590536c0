#!/usr/bin/env python3
"""Checks that the official `openai` Python client works with a running mlxcel-server:
structured output with a Pydantic model (`chat.completions.parse`), forced tool calls
(whole and streamed), a call in the model's own format streamed as argument deltas and
accumulated as clients do, `n` choices and `reasoning`-free plain chat. Random-weight fixture
models are fine: every check is about the API's shape and constraints, not the text.

    mlxcel-server -m tests/fixtures/qwen2 --port 8099 &
    python3 scripts/openai_client_check.py --port 8099
    # other formats: -m tests/fixtures/llama3 ... --tool-format llama3_json

Needs `pip install openai` (it brings pydantic). Exits non-zero on the first failure.
"""
import argparse
import json
from typing import Literal

import openai
from pydantic import BaseModel, Field


class Weather(BaseModel):
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather",
            "parameters": Weather.model_json_schema() | {"additionalProperties": False},
        },
    }
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--tool-format", default="hermes", choices=["hermes", "llama3_json", "mistral"],
                    help="the server's tool-call format (hermes for the qwen2 fixture)")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=f"http://{args.host}:{args.port}/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "weather in Oslo?"}]

    # structured output with a Pydantic model
    for seed in range(5):
        r = client.chat.completions.parse(
            model=model, messages=messages, response_format=Weather,
            temperature=1.0, seed=seed, max_tokens=64,
        )
        w = r.choices[0].message.parsed
        assert isinstance(w, Weather), r
        assert r.choices[0].finish_reason == "stop", r
    print("parse: ok", w)

    # forced tool calls, whole
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="required",
        temperature=1.0, seed=1, max_tokens=200,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", r
    calls = c.message.tool_calls
    assert calls and all(t.function.name == "get_weather" for t in calls), r
    for t in calls:
        Weather.model_validate_json(t.function.arguments)
    print("tools: ok", calls[0].function.arguments)

    # forced tool call, streamed
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0, seed=2, max_tokens=200,
    )
    args_text, names, finish = {}, {}, None
    for chunk in stream:
        ch = chunk.choices[0]
        for t in ch.delta.tool_calls or []:
            if t.function.name:
                names[t.index] = t.function.name
            args_text[t.index] = args_text.get(t.index, "") + (t.function.arguments or "")
        finish = ch.finish_reason or finish
    assert finish == "tool_calls" and names == {0: "get_weather"}, (finish, names)
    Weather.model_validate_json(args_text[0])
    print("streamed tool call: ok", args_text[0])

    # a call in the model's own format (`tool_choice` auto), streamed as argument deltas:
    # random weights never write one, so `guided_regex` makes the model write it
    regex = {
        "hermes": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}\n</tool_call>',
        "llama3_json": r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}',
        "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}\]',
    }[args.tool_format]
    body = dict(model=model, messages=messages, tools=TOOLS, temperature=1.0, seed=4,
                max_tokens=200, extra_body={"guided_regex": regex})
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    chunks = 0
    acc = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **body):
        ch = chunk.choices[0]
        assert not (ch.delta.content or ""), ch  # no call markup in content
        for t in ch.delta.tool_calls or []:
            chunks += 1
            if t.index not in acc:
                # the first chunk of a call: its id, type and name
                assert t.id and t.type == "function" and t.function.name, t
                acc[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
            else:
                assert not t.id and not t.function.name, t
            acc[t.index]["arguments"] += t.function.arguments or ""
        finish = ch.finish_reason or finish
    assert finish == "tool_calls", finish
    assert chunks > 3, f"the call came in {chunks} chunk(s), not as argument deltas"
    assert list(acc) == [0], acc
    assert acc[0]["name"] == call.function.name, (acc, call)
    assert acc[0]["arguments"] == call.function.arguments, (acc, call)
    Weather.model_validate_json(acc[0]["arguments"])
    print(f"streamed {args.tool_format} call: ok, {chunks} chunks:", acc[0]["arguments"])

    # a conversation with the call and its result, then n = 3
    r = client.chat.completions.create(
        model=model, n=3, temperature=1.0, seed=3, max_tokens=8, tools=TOOLS,
        tool_choice="none",
        messages=messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call00001", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "days": 2})}}]},
            {"role": "tool", "tool_call_id": "call00001", "content": "sunny"},
        ],
    )
    assert [c.index for c in r.choices] == [0, 1, 2], r
    print("n=3 after a tool turn: ok")


if __name__ == "__main__":
    main()
