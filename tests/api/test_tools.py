"""Tool calling through the real clients, against the running stack (the real default model): the openai SDK's
chat (whole and streamed) and Responses, the anthropic SDK's tool use, the OpenAI Agents SDK running a function
tool, and instructor in TOOLS mode. Every call a client gets names a declared tool and fits its schema: the grammar
holds it (shared/grammar/tools.py), the parser reads it (shared/tool_parsers/)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city now.",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string", "maxLength": 40}},
                                             "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 80}


@pytest.fixture
def client(stack) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def _valid(call_name: str, arguments: str) -> dict[str, Any]:
    schema = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}[call_name]
    args = json.loads(arguments)
    jsonschema.validate(args, schema)
    return args  # type: ignore[no-any-return]


def test_a_required_call_comes_whole_and_streamed_the_same(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                          parallel_tool_calls=False, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    _valid(call.function.name, call.function.arguments)
    assert full.usage and full.usage.completion_tokens > 0

    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                                 tool_choice="required", parallel_tool_calls=False, stream=True,
                                                 **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any("<tool_call>" in (d.content or "") for d in deltas)  # the markup is never content
    parts = [tc for d in deltas for tc in d.tool_calls or []]
    first = parts[0]  # index, id and name first
    assert first.id and first.id.startswith("call_") and first.function.name == call.function.name
    assert all(p.index == 0 for p in parts) and all(p.id is None for p in parts[1:])
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_named_tool_is_the_one_called_and_its_answer_goes_back(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                           **GREEDY)
    [call] = first.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"
    _valid("get_time", call.function.arguments)
    conversation = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "It is 14:05 in Paris."}]
    second = client.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER, TIME],
                                            tool_choice="none", **GREEDY)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    assert second.choices[0].finish_reason in ("stop", "length")


def test_auto_gives_text_or_valid_calls(client: openai.OpenAI) -> None:
    for question in ("Hi! How are you?", "Call get_weather for Paris in celsius."):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                             tools=[WEATHER], **GREEDY).choices[0]
        for call in out.message.tool_calls or []:
            _valid(call.function.name, call.function.arguments)
        assert out.message.tool_calls or out.message.content
        assert "<tool_call>" not in (out.message.content or "")


def test_responses_function_calls_and_their_outputs(client: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "name": "get_weather", "description": "The weather in a city now.",
                   "parameters": WEATHER_PARAMS}]
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                    tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_output_tokens=80)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    _valid("get_weather", calls[0].arguments)
    assert first.tool_choice == "required" and first.tools and first.tools[0].name == "get_weather"

    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=tools,
                                 tool_choice="required", parallel_tool_calls=False, temperature=0,
                                 max_output_tokens=80) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments
    assert [i.type for i in final.output] == [i.type for i in first.output]

    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=tools, temperature=0,
                                     max_output_tokens=40, tool_choice="none", input=[
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "Sunny, 21 degrees."}])
    assert second.status in ("completed", "incomplete") and second.output_text


def test_anthropic_tool_use(stack) -> None:  # type: ignore[no-untyped-def]
    claude = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    tools: Any = [{"name": "get_weather", "description": "The weather in a city now.",
                   "input_schema": WEATHER_PARAMS}]
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    ONE: Any = {"type": "any", "disable_parallel_tool_use": True}  # noqa: N806
    msg = claude.messages.create(model=MODEL, max_tokens=80, tools=tools, tool_choice=ONE,
                                 messages=ask, extra_body={"temperature": 0})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) >= 1
    assert uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_PARAMS)

    with claude.messages.stream(model=MODEL, max_tokens=80, tools=tools, tool_choice=ONE,
                                messages=ask, extra_body={"temperature": 0}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's event for an input_json_delta
    assert [b.model_dump(exclude={"id"}) for b in final.content] == [b.model_dump(exclude={"id"}) for b in msg.content]
    assert final.stop_reason == "tool_use"

    answer = claude.messages.create(model=MODEL, max_tokens=40, tools=tools, extra_body={"temperature": 0},
                                    messages=[*ask, {"role": "assistant", "content": msg.content},
                                              {"role": "user", "content": [{"type": "tool_result",
                                                                            "tool_use_id": uses[0].id,
                                                                            "content": "Sunny, 21 degrees."}]}],
                                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


def test_the_agents_sdk_runs_a_function_tool(stack) -> None:  # type: ignore[no-untyped-def]
    import agents

    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        seen.append(city)
        return f"Sunny in {city}"

    async def main() -> Any:  # the client closed in the loop it ran in (test_openai.py's test_async_client says why)
        async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0) as client:
            model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
            agent = agents.Agent(name="weather", instructions="Answer with the tools you have.", model=model,
                                 tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                                 model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                                     temperature=0, max_tokens=60))
            return await agents.Runner.run(agent, "What is the weather in Paris?",
                                           run_config=agents.RunConfig(tracing_disabled=True))

    result = asyncio.run(main())
    assert len(seen) == 1 and result.final_output == f"Sunny in {seen[0]}"


def test_instructor_tools_mode(stack) -> None:  # type: ignore[no-untyped-def]
    import instructor
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=40)
        country: str = Field(max_length=40)
        population_millions: float

    patched = instructor.from_openai(openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0),
                                     mode=instructor.Mode.TOOLS)
    city = patched.chat.completions.create(model=MODEL, response_model=City, max_retries=0, temperature=0,
                                           max_tokens=80,
                                           messages=[{"role": "user", "content": "Tell me about Paris."}])
    assert isinstance(city, City) and city.name


def test_tools_beside_a_response_format_give_calls_or_the_answer_in_form(client: openai.OpenAI) -> None:
    """What an agent with tools and a structured output type sends (the Agents SDK's `output_type`): the reply is
    calls to declared tools, or the answer held to the schema, whole and streamed alike."""
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": answer, "strict": True}}
    for messages in (ASK, turns):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                               response_format=fmt, **GREEDY).choices[0]  # type: ignore[arg-type]
        if reply.message.tool_calls:
            assert reply.finish_reason == "tool_calls" and not reply.message.content
            for call in reply.message.tool_calls:
                _valid(call.function.name, call.function.arguments)
        else:
            assert reply.finish_reason == "stop"
            jsonschema.validate(json.loads(reply.message.content or ""), answer)
        streamed = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                                  response_format=fmt, stream=True, **GREEDY)  # type: ignore[arg-type]
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == (reply.message.content or "")
