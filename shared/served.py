"""The models a deployment serves (`MODELS`), each with a queue and an inference pool of its own.

`MODELS` takes `name=path` items (separated by commas or spaces), JSON objects `{"name", "path", "min_replicas",
"max_replicas"}`, or a JSON list of those. The first model is the default: a request that names no model runs on
it, and its queue keeps the names a one-model deployment has (shared/names.py `model_prefix`), so that one model is
exactly the deployment without MODELS. Every other model's queue and pool are named by its name (its *key*). A
model's pool bounds default to INFERENCE_MIN and INFERENCE_MAX. No torch here: the API reads this too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shared.lora import setting_items

# a model's name is a key part (`conveyor:{p0}:m:<name>:...`) and a pool's (`inference:<name>`): no ':' nor braces
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class ServedModel:
    """A model served: the name requests give as `model`, its local directory, its pool's bounds (None: the
    deployment's INFERENCE_MIN / INFERENCE_MAX)."""
    name: str
    path: str
    min_replicas: int | None = None
    max_replicas: int | None = None


def _bound(item: dict[str, Any], field: str) -> int | None:
    value = item.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1000:
        raise ValueError(f"MODELS: {item.get('name')!r}: {field} must be an integer from 0 to 1000")
    return value


FIELDS = {"name", "path", "min_replicas", "max_replicas"}  # a MODELS object's


def parse_models(value: str) -> list[ServedModel]:
    """`MODELS` as a list, the default first; ValueError naming the item at fault."""
    out: list[ServedModel] = []
    for item in setting_items(value):
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"MODELS: {item!r} is not name=path")
            model = ServedModel(name, path)
        elif isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str):
            if unknown := sorted(set(item) - FIELDS):  # a misspelt bound would be ignored silently
                raise ValueError(f"MODELS: {item['name']!r} has unknown fields {unknown}; known: {sorted(FIELDS)}")
            model = ServedModel(item["name"], item["path"], _bound(item, "min_replicas"), _bound(item, "max_replicas"))
            if model.max_replicas == 0 or (model.min_replicas or 0) > (model.max_replicas or 1 << 30):
                raise ValueError(f"MODELS: {model.name!r}: max_replicas must be at least 1 and at least min_replicas "
                                 f"(got {model.min_replicas}, {model.max_replicas})")
        else:
            raise ValueError(f"MODELS: {item!r} has no string 'name' and 'path'")
        if not NAME.match(model.name):
            raise ValueError(f"MODELS: the model name {model.name!r} must be 1-64 letters, digits or ._- (not first)")
        if model.name in {m.name for m in out}:
            raise ValueError(f"MODELS: {model.name!r} is named twice")
        out.append(model)
    return out
