"""Prompt building without torch or transformers: the model's chat template via jinja2, token ids
via the `tokenizers` library.

A conversation with tools (or with tool turns: assistant `tool_calls`, `tool` messages) is rendered with the
model's own template when that template renders `tools`, else with the tool template (TOOL_CHAT_TEMPLATE; by
default the Hermes tool prompt beside this module, whose calls the `hermes` parser reads). Templates get
transformers' `tojson` (keys in their order, nothing HTML-escaped), as they were written for."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from shared.schemas import GenerationRequest, Message


class PromptError(ValueError):
    """The request cannot become a prompt (template error, too long): the job fails with this message."""


def _raise(message: str) -> None:
    raise TemplateError(message)


HERMES_TEMPLATE = Path(__file__).with_name("tool_chat_template_hermes.jinja")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    """transformers' `tojson` filter (jinja2's own sorts keys and escapes HTML)."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _for_template(message: Message) -> dict[str, Any]:
    """A message as chat templates take it: an assistant's tool calls' arguments as objects, not JSON text
    (transformers' convention, which tool templates follow: `arguments | tojson`; vLLM converts them the same way)."""
    out = message.model_dump(exclude_none=True, warnings=False)
    for call in out.get("tool_calls") or []:
        fn = call.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
            except ValueError:  # the door lets only an object's JSON text through; left as it came otherwise
                pass
    return out


class PromptBuilder:
    def __init__(self, model_dir: str | Path, tool_template: str | Path = "") -> None:
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (model_dir / "tokenizer_config.json").exists():
            config = json.loads((model_dir / "tokenizer_config.json").read_text())
        source = config.get("chat_template")
        if (model_dir / "chat_template.jinja").exists():
            source = (model_dir / "chat_template.jinja").read_text()
        self.special = {k: v for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                        if isinstance(v := config.get(k), str)}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.template = env.from_string(source) if isinstance(source, str) else None
        self.tool_template: Template | None
        if tool_template:
            self.tool_template = env.from_string(Path(tool_template).read_text())
        elif isinstance(source, str) and "tools" in source:
            self.tool_template = self.template
        else:
            self.tool_template = env.from_string(HERMES_TEMPLATE.read_text())

    def render(self, req: GenerationRequest) -> str:
        if req.prompt is not None:
            return req.prompt
        messages = req.messages or []
        if req.continue_final_message:
            return self.continued(messages, req.prompt_tools)
        return self.chat(messages, add_generation_prompt=True, tools=req.prompt_tools)

    def continued(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation with its last (assistant) message left open, for the output to continue it: rendered
        whole, then cut after that message's text, as transformers' `continue_final_message` does."""
        final = messages[-1].content
        rendered = self.chat(messages, add_generation_prompt=False, tools=tools)
        at = rendered.rfind(final) if final else -1
        if at < 0:  # a template that changes the text: the turn opened, the text appended
            return self.chat(messages[:-1], add_generation_prompt=True, tools=tools) + final
        return rendered[:at + len(final)]

    def chat(self, messages: list[Message], add_generation_prompt: bool,
             tools: list[dict[str, Any]] | None = None) -> str:
        """The messages through the chat template (the tool template with tools or tool turns); PromptError when
        there is none or it refuses them."""
        with_tools = bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
        template = self.tool_template if with_tools else self.template
        if template is None:
            raise PromptError("this model has no chat template: send 'prompt' instead of 'messages'")
        try:
            return template.render(messages=[_for_template(m) for m in messages],
                                   tools=tools or None, add_generation_prompt=add_generation_prompt, **self.special)
        except TemplateError as exc:
            raise PromptError(f"chat template rejected the messages: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def token_strs(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The ids' text; PromptError naming the first id outside the vocabulary."""
        vocab = self.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary (0 to {vocab - 1})")
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def encode_batch(self, texts: list[str], raw: list[bool]) -> list[list[int]]:
        """Chat-rendered prompts already hold their special tokens as text; raw prompts get the
        tokenizer's own special tokens (a BOS, if it adds one)."""
        chat = [i for i, r in enumerate(raw) if not r]
        plain = [i for i, r in enumerate(raw) if r]
        out: list[list[int]] = [[] for _ in texts]
        for idxs, add_special in ((chat, False), (plain, True)):
            if idxs:
                encs = self.tokenizer.encode_batch([texts[i] for i in idxs], add_special_tokens=add_special)
                for i, enc in zip(idxs, encs):
                    out[i] = enc.ids
        return out
