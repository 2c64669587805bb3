"""Prompt building without torch or transformers: the model's chat template via jinja2, token ids
via the `tokenizers` library."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from shared.schemas import GenerationRequest


class PromptError(ValueError):
    """The request cannot become a prompt (template error, too long): the job fails with this message."""


def _raise(message: str) -> None:
    raise TemplateError(message)


class PromptBuilder:
    def __init__(self, model_dir: str | Path) -> None:
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
        self.template = env.from_string(source) if isinstance(source, str) else None

    def render(self, req: GenerationRequest) -> str:
        if req.prompt is not None:
            return req.prompt
        if self.template is None:
            raise PromptError("this model has no chat template: send 'prompt' instead of 'messages'")
        messages = [m.model_dump() for m in req.messages or []]
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as exc:
            raise PromptError(f"chat template rejected the messages: {exc}") from exc

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
