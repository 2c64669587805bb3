"""What the door answers to tools it cannot take, on every route that takes them: a 400 naming the parameter (a
422 on /v1/jobs, as for any field there), never a 500, and nothing queued. The API runs in process (no workers)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
OK_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
UNENFORCEABLE = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}

CHAT_REFUSED = [
    ({"tools": [OK_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [OK_TOOL, UNENFORCEABLE]}, "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [OK_TOOL, OK_TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [OK_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [OK_TOOL], "guided_regex": "a+"}, "tools"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "tool", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {  # type: ignore[index]
        "name": "get_weather", "arguments": "not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),  # arguments are an object
]


@pytest.mark.parametrize(("extra", "param"), CHAT_REFUSED)
async def test_chat_refuses_naming_the_parameter(app_client: httpx.AsyncClient, extra: dict[str, Any],
                                                 param: str) -> None:
    r = await app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 8,
                                                            **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


async def test_too_many_tools_are_refused(app_client: httpx.AsyncClient) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    r = await app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": tools})
    assert r.status_code == 400 and "tools" in r.text


async def test_a_tool_schema_too_large_to_compile_quickly_is_refused(app_client: httpx.AsyncClient) -> None:
    props = {f"p{i}": {"type": "object", "properties": {f"q{j}": {"type": "string"} for j in range(60)}}
             for i in range(200)}
    big = {"type": "function", "function": {"name": "big", "parameters": {"type": "object", "properties": props}}}
    r = await app_client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [big],
                                                            "tool_choice": "required"})
    assert r.status_code in (400, 413), r.text
    assert r.json()["error"]["param"] in ("tools", "tools[0].function.parameters")


async def test_responses_and_messages_refuse_naming_the_parameter(app_client: httpx.AsyncClient) -> None:
    flat = {"type": "function", "name": "get_weather", "parameters": OK_TOOL["function"]["parameters"]}  # type: ignore[index]
    r = await app_client.post("/v1/responses", json={"model": MODEL, "input": "hi", "tools": [flat],
                                                     "tool_choice": {"type": "function", "name": "nope"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    r = await app_client.post("/v1/responses", json={"model": MODEL, "input": [
        {"type": "function_call_output", "call_id": "call_9", "output": "x"}]})
    assert r.status_code == 400 and "answers no earlier tool call" in r.text, r.text
    r = await app_client.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": ASK, "tools": [
        {"name": "f", "input_schema": {"type": "object", "not": {}}}]})
    assert r.status_code == 400 and r.json()["type"] == "error" and "tools[0]" in r.json()["error"]["message"]
    r = await app_client.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": ASK,
                                                    "tool_choice": {"type": "tool", "name": "nope"},
                                                    "tools": [{"name": "f", "input_schema": {"type": "object"}}]})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"]


async def test_jobs_take_the_same_fields(app_client: httpx.AsyncClient) -> None:
    r = await app_client.post("/v1/jobs", json={"messages": ASK, "tools": [OK_TOOL, UNENFORCEABLE]})
    assert r.status_code == 422 and "tools[1].function.parameters" in r.text
    r = await app_client.post("/v1/jobs", json={"prompt": "hi", "tools": [OK_TOOL]})
    assert r.status_code == 422 and "tools need 'messages'" in r.text
    # a call without arguments, written "" by some clients, goes back as {} (the prompt renders it so)
    empty = {**CALLED, "content": "", "tool_calls": [{**CALLED["tool_calls"][0], "function": {  # type: ignore[index]
        "name": "get_weather", "arguments": ""}}]}
    r = await app_client.post("/v1/jobs", json={"messages": [*ASK, empty, {"role": "tool", "tool_call_id": "call_1",
                                                                          "content": "sunny"}], "tools": [OK_TOOL]})
    assert r.status_code == 202, r.text


async def test_an_agents_many_described_tools_are_taken(app_client: httpx.AsyncClient) -> None:
    """40 tools of ~1 KB each, most of it descriptions (an agent's file tools): the grammar holds their
    constraints only, so they pass the size bound, and the job is queued."""
    prose = "Read part of a file in the workspace; paths are relative to its root. " * 6
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": prose, "parameters": {
        "type": "object", "title": "Arguments", "required": ["path"], "properties": {
            "path": {"type": "string", "description": prose},
            "description": {"type": "string", "description": "a property named like a keyword stays"},
            "lines": {"type": "array", "items": {"type": "integer", "description": prose}}}}}} for i in range(40)]
    assert len(str(tools)) > 40_000
    r = await app_client.post("/v1/jobs", json={"messages": ASK, "max_tokens": 8, "tools": tools})
    assert r.status_code == 202, r.text


def test_the_grammar_keeps_constraints_and_property_names() -> None:
    from shared.grammar.tools import tools_spec

    schema = {"type": "object", "description": "d", "title": "t", "required": ["description"], "properties": {
        "description": {"type": "string", "description": "x", "enum": ["a", "b"]},
        "n": {"anyOf": [{"type": "integer", "title": "i"}, {"type": "null"}], "examples": [1]}}}
    spec = tools_spec([{"type": "function", "function": {"name": "f", "parameters": schema}}], "auto")
    assert spec is not None
    assert json.loads(spec.source)["tools"][0]["parameters"] == {
        "type": "object", "required": ["description"], "properties": {
            "description": {"type": "string", "enum": ["a", "b"]},
            "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
