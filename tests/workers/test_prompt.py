"""The tokenizer's prompt building (workers/tokenizer/prompt.py) with the real default model's files: tools and tool
turns through the Hermes tool prompt (the model's own template has none), as the `hermes` parser reads them back,
transformers' `tojson`, and a final assistant message continued."""

from __future__ import annotations

import json

from shared.schemas import GenerationRequest
from shared.tool_parsers import parse
from workers.tokenizer.prompt import PromptBuilder

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & 'later'",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
ASK = {"role": "user", "content": "Weather in Paris?"}


def test_tools_and_tool_turns_render_in_the_hermes_format(model_path: str) -> None:
    pb = PromptBuilder(model_path)
    req = GenerationRequest(messages=[ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=[TOOL])
    text = pb.render(req)
    # the tool as JSON in its own key order, nothing HTML-escaped (jinja2's own tojson would sort and escape)
    assert json.dumps(TOOL["function"]) in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse("hermes", turn).calls[0].arguments == '{"city": "Paris"}'  # what the parser reads back
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = pb.render(GenerationRequest(messages=[ASK]))
    assert "<tools>" not in plain and plain == pb.render(GenerationRequest(messages=[ASK], tools=[TOOL],
                                                                           tool_choice="none"))


def test_a_final_assistant_message_is_left_open(model_path: str) -> None:
    pb = PromptBuilder(model_path)
    req = GenerationRequest(messages=[ASK, {"role": "assistant", "content": "It is"}], continue_final_message=True)
    answered = pb.render(GenerationRequest(messages=[ASK]))
    assert pb.render(req) == answered + "It is"
    assert GenerationRequest.from_wire(req.model_dump_json(exclude_defaults=True)).continue_final_message


def test_a_models_own_tool_template_gets_arguments_as_objects(model_path: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A template that renders `tools` itself (Qwen's, Llama 3's) takes a call's arguments as an object and writes
    them with `tojson`, as transformers passes them: JSON text would come out encoded twice."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_path}/{name}", tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
        "<call>{{ c.function.arguments | tojson }}</call>{% endfor %}\n{% endfor %}{% if tools %}[tools]{% endif %}")
    pb = PromptBuilder(tmp_path)
    text = pb.render(GenerationRequest(messages=[ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                                                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
                                       tools=[TOOL]))
    assert '<call>{"city": "Paris"}</call>' in text and "[tools]" in text
