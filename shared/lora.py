"""LoRA adapters as every stage sees them, without torch: the adapters a deployment serves (`LORA_MODULES`, in
vLLM's forms, and those loaded at run time into the registry), and a PEFT adapter directory checked against its
base model from its files alone (`adapter_config.json`, and the shapes in the header of
`adapter_model.safetensors`), so that a bad adapter is refused with a clear error where it is named, before any
worker reads its weights (gpu_worker/engine/lora.py).

What is served, as vLLM serves it (vllm/lora/peft_helper.py): LoRA on the attention and MLP projections (q, k, v,
o, gate, up, down), ranks up to MAX_LORA_RANK, `rank_pattern`/`alpha_pattern`, rsLoRA's scaling. Refused: DoRA,
LoRA biases, `modules_to_save`, embedding adapters and initialisations that change the base (PiSSA, OLoRA, ...).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared import names
from shared.model_config import model_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
# a PEFT key: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_REFUSED_INIT = ("pissa", "olora", "corda", "loftq", "eva")
_SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}


class AdapterError(ValueError):
    """An adapter that cannot be served: the message says why, for the client that named it."""


@dataclass(frozen=True)
class LoraModule:
    """An adapter a deployment serves: the name requests give as `model`, its directory, its base's name."""
    name: str
    path: str
    base_model_name: str = ""

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "path": self.path, "base_model_name": self.base_model_name})

    @classmethod
    def from_json(cls, raw: str | bytes) -> LoraModule:
        d = json.loads(raw)
        return cls(str(d["name"]), str(d["path"]), str(d.get("base_model_name") or ""))


@dataclass(frozen=True)
class Dims:
    """The base model's projection shapes, (out, in) per target module, and its layer count."""
    layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, model_dir: str) -> Dims:
        return cls.of_config(model_config(model_dir))

    @classmethod
    def of_config(cls, cfg: dict[str, Any]) -> Dims:
        """From a model's config.json (KeyError for a config without a Llama-family layer's sizes)."""
        cfg = cfg.get("text_config") or cfg
        hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        q, kv_out = heads * head_dim, kv * head_dim
        return cls(int(cfg["num_hidden_layers"]), {
            "q_proj": (q, hidden), "k_proj": (kv_out, hidden), "v_proj": (kv_out, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)})


@dataclass(frozen=True)
class AdapterInfo:
    """A checked adapter: per (layer, module) its rank and scaling; the weights' dtype as saved."""
    ranks: dict[tuple[int, str], int] = field(default_factory=dict)
    scaling: dict[tuple[int, str], float] = field(default_factory=dict)
    dtype: str = "F32"

    @property
    def max_rank(self) -> int:
        return max(self.ranks.values(), default=0)


def parse_modules(value: str, default_base: str) -> list[LoraModule]:
    """`LORA_MODULES` in vLLM's forms: items `name=path` (separated by spaces or commas), JSON objects
    `{"name": ..., "path": ..., "base_model_name": ...}`, or a JSON list of those; ValueError naming the item at
    fault. An adapter without a base is on the default model."""
    out: list[LoraModule] = []
    for item in setting_items(value):
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"LORA_MODULES: {item!r} is not name=path")
            module = LoraModule(name, path, default_base)
        elif isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str):
            module = LoraModule(item["name"], item["path"], str(item.get("base_model_name") or default_base))
        else:
            raise ValueError(f"LORA_MODULES: {item!r} has no string 'name' and 'path'")
        check_name(module.name)
        if module.name in {m.name for m in out}:
            raise ValueError(f"LORA_MODULES: {module.name!r} is named twice")
        out.append(module)
    return out


def setting_items(value: str) -> list[Any]:
    """The items of a setting in vLLM's list forms (LORA_MODULES, MODELS): `name=path` strings separated by spaces
    or commas, JSON objects one after another, or a JSON list of them."""
    value = value.strip()
    if not value:
        return []
    if value[0] in "[{":
        try:
            parsed = json.loads(value)
        except ValueError:
            return json_objects(value)
        return parsed if isinstance(parsed, list) else [parsed]
    return [t for t in re.split(r"[\s,]+", value) if t]


def json_objects(value: str) -> list[Any]:
    """Several JSON objects one after another (vLLM's CLI form, one per argument, given in one variable)."""
    decoder, at, out = json.JSONDecoder(), 0, []
    while at < len(value):
        while at < len(value) and value[at] in " \t\r\n,":
            at += 1
        if at >= len(value):
            break
        try:
            obj, at = decoder.raw_decode(value, at)
        except ValueError as exc:
            raise ValueError(f"LORA_MODULES: not JSON at character {at}: {exc}") from None
        out.append(obj)
    return out


def check_name(name: str) -> None:
    if not NAME.match(name):
        raise ValueError(f"the adapter name {name!r} must be 1-128 letters, digits or ._:/- (not first)")


def _header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: tensor name -> {dtype, shape, data_offsets}."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise AdapterError(f"{path.name} is not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise AdapterError(f"{path.name} is not a safetensors file (a {n}-byte header)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise AdapterError(f"{path.name} is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path.name} is not a safetensors file")
    header.pop("__metadata__", None)
    return header


def _pattern(patterns: dict[str, Any], key: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the pattern that matches the
    end of the module's key, as a regex (`re.match(rf'(.*\\.)?({pattern})$', key)`), else `default`."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return float(value)
    return default


def read_config(directory: Path) -> dict[str, Any]:
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"no {CONFIG_FILE} in {directory}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{CONFIG_FILE} in {directory} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} in {directory} is not a JSON object")
    return config


def check_adapter(path: str, base: Dims, max_rank: int) -> AdapterInfo:
    """The adapter at `path` checked against its base's shapes from its files alone; AdapterError saying what
    does not fit (a missing file, a feature not served, a rank above `max_rank`, a shape the base does not have)."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"no adapter directory at {path}")
    config = read_config(directory)
    _check_features(config)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise AdapterError(f"no {WEIGHTS_FILE} in {path} (adapter_model.bin is not read: save with safetensors)")
    pairs, dtypes = _weight_pairs(_header(weights), base)
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} in {path} holds no LoRA weights")
    r, alpha = int(config.get("r") or 8), float(config.get("lora_alpha") or 8)
    rslora = bool(config.get("use_rslora"))
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    info = AdapterInfo()
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be given")
        out_dim, in_dim = base.shapes[module]
        a, b = ab["A"], ab["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise AdapterError(f"{where}: lora_A {a} and lora_B {b} are not [r, in] and [out, r]")
        rank = a[0]
        if a[1] != in_dim or b[0] != out_dim:
            raise AdapterError(f"{where}: lora_A {a} and lora_B {b} do not fit the base model's [{out_dim}, {in_dim}]")
        if not 1 <= rank <= max_rank:
            raise AdapterError(f"{where}: rank {rank} is above the most served, MAX_LORA_RANK {max_rank}")
        pattern_key = f"model.layers.{layer}.{'self_attn' if module in TARGETS[:4] else 'mlp'}.{module}"
        want_r = _pattern(ranks, pattern_key, r)
        if int(want_r) != rank:
            raise AdapterError(f"{where}: rank {rank}, but adapter_config.json says {int(want_r)}")
        a_ = _pattern(alphas, pattern_key, alpha)
        info.ranks[(layer, module)] = rank
        info.scaling[(layer, module)] = a_ / math.sqrt(rank) if rslora else a_ / rank
    return AdapterInfo(info.ranks, info.scaling, dtypes.pop() if len(dtypes) == 1 else "F32")


def _check_features(config: dict[str, Any]) -> None:
    """AdapterError naming the first feature of an adapter's config that is not served."""
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not served: only LoRA adapters are")
    refused = {"use_dora": "DoRA", "lora_bias": "LoRA biases"}
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{what} ({key}) is not served")
    if str(config.get("bias", "none")) != "none":
        raise AdapterError(f"bias {config.get('bias')!r} is not served: only bias 'none'")
    if config.get("modules_to_save"):
        raise AdapterError("modules_to_save is not served: the adapter must change only LoRA weights")
    if str(config.get("init_lora_weights", "")).lower().startswith(_REFUSED_INIT):
        raise AdapterError(f"init_lora_weights {config['init_lora_weights']!r} changes the base model's weights: "
                           "not served")
    if config.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out is not served (a Conv1D base)")


def _weight_pairs(header: dict[str, Any], base: Dims) -> tuple[dict[tuple[int, str], dict[str, list[int]]], set[str]]:
    """The shapes of an adapter's A and B matrices by (layer, module), and their dtypes, from its safetensors
    header; AdapterError naming a tensor that is not served (another kind of weight, a module, a layer past the
    base's, a dtype)."""
    dtypes: set[str] = set()
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for key, meta in header.items():
        m = KEY.match(key)
        if m is None:
            what = "embedding adapters" if "lora_embedding" in key else "weights other than LoRA's A and B"
            raise AdapterError(f"{key}: {what} are not served")
        layer, module, ab = int(m[1]), m[2], m[3]
        if module not in TARGETS:
            raise AdapterError(f"{key}: LoRA on {module} is not served (only {', '.join(TARGETS)})")
        if layer >= base.layers:
            raise AdapterError(f"{key}: the base model has {base.layers} layers")
        if meta.get("dtype") not in _SAFETENSORS_DTYPES:
            raise AdapterError(f"{key}: dtype {meta.get('dtype')} is not served (F32, F16 or BF16)")
        dtypes.add(meta["dtype"])
        pairs.setdefault((layer, module), {})[ab] = [int(d) for d in meta.get("shape", [])]
    return pairs, dtypes


def static_modules(value: str, default_base: str) -> dict[str, LoraModule]:
    return {m.name: m for m in parse_modules(value, default_base)}


def registered(client: Any, name: str) -> LoraModule | None:
    """An adapter loaded at run time (POST /v1/load_lora_adapter), from the registry; None when not there."""
    raw = client.hget(names.LORAS, name)
    return LoraModule.from_json(raw) if raw else None
