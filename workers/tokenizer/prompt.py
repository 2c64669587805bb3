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

from shared.schemas import GenerationRequest, Message


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
        return self.chat(req.messages or [], add_generation_prompt=True)

    def chat(self, messages: list[Message], add_generation_prompt: bool) -> str:
        """The messages through the chat template; PromptError when there is none or it refuses them."""
        if self.template is None:
            raise PromptError("this model has no chat template: send 'prompt' instead of 'messages'")
        try:
            return self.template.render(messages=[m.model_dump() for m in messages],
                                        add_generation_prompt=add_generation_prompt, **self.special)
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
