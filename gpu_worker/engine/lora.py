"""LoRA adapters in the engine: their weights as the model's fused projections take them, the adapters resident in
a worker (at most MAX_LORAS, least recently used evicted), and a step's rows grouped by adapter.

A PEFT adapter changes a projection W to W + s * B @ A (A [r, in], B [out, r], s its scaling: alpha / r, or
alpha / sqrt(r) with rsLoRA). The model fuses q/k/v and gate/up into one matrix each (models/llama.py), so an
adapter's parts are fused the same way: their A stacked ([r_q + r_k + r_v, in]), their B block-diagonal with the
scaling folded in ([out_q + out_k + out_v, r_q + r_k + r_v]); a part the adapter leaves alone is a zero block.

A step's rows are grouped by adapter: each adapter's rows are gathered (index_select), go through its two small
GEMMs, and are added onto the projection's output (index_add: each row once). On these CPUs that beat gathering
per-row adapter matrices and one bmm at every size tried (576 -> 1536 at rank 64, 32 rows: 0.28 ms against 1.76;
BENCHMARKS.md, "LoRA"). The GEMMs are the base's own backend (gemm.py), so an adapter row's bits do not depend on
the rows beside it (batch invariance: `test_lora.py`). Rows without an adapter are computed exactly as without
LoRA; a step in which no row has one runs the base path alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from gpu_worker.engine.gemm import Gemm
from shared.lora import KEY, WEIGHTS_FILE, AdapterError, Dims, check_adapter

log = logging.getLogger("conveyor.engine")

FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


@dataclass
class Delta:
    """One fused projection's update: y += (x @ a.T) @ b.T, `a` and `b` as the GEMM backend prepared them."""
    a: torch.Tensor
    b: torch.Tensor


class LoraAdapter:
    """An adapter's weights, per layer one Delta per fused projection it changes (None where it changes none)."""

    def __init__(self, name: str, path: str, layers: list[dict[str, Delta]], salt: int) -> None:
        self.name, self.path, self.layers = name, path, layers
        self.salt = salt  # seeds its sequences' prefix-cache hashes: K/V computed under it serve only it

    @classmethod
    def load(cls, name: str, path: str, dims: Dims, dtype: torch.dtype, device: torch.device, gemm: Gemm,
             max_rank: int) -> LoraAdapter:
        """Read and check a PEFT adapter directory (AdapterError saying what does not fit)."""
        info = check_adapter(path, dims, max_rank)
        try:
            tensors = load_file(str(Path(path) / WEIGHTS_FILE))
        except Exception as exc:  # noqa: BLE001 - an unreadable file is this adapter's error
            raise AdapterError(f"{WEIGHTS_FILE} in {path} cannot be read: {exc}") from None
        parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = KEY.match(key)
            assert m is not None  # check_adapter refused any other key
            parts.setdefault((int(m[1]), m[2]), {})[m[3]] = t.to(torch.float32)
        layers: list[dict[str, Delta]] = []
        with torch.no_grad():
            for li in range(dims.layers):
                fused: dict[str, Delta] = {}
                for proj, modules in FUSED.items():
                    present = [mod for mod in modules if (li, mod) in parts]
                    if not present:
                        continue
                    a_parts, b_blocks, cols = [], [], 0
                    ranks = [info.ranks.get((li, mod), 0) for mod in modules]
                    width = sum(ranks)
                    for mod, r in zip(modules, ranks):
                        out_dim = dims.shapes[mod][0]
                        block = torch.zeros(out_dim, width)
                        if r:
                            a_parts.append(parts[(li, mod)]["A"])
                            block[:, cols : cols + r] = parts[(li, mod)]["B"] * info.scaling[(li, mod)]
                            cols += r
                        b_blocks.append(block)
                    a = torch.cat(a_parts).to(device=device, dtype=dtype)
                    b = torch.cat(b_blocks).to(device=device, dtype=dtype)
                    fused[proj] = Delta(gemm.prepare(a), gemm.prepare(b))
                layers.append(fused)
        return cls(name, path, layers, hash(("lora", name, str(Path(path).resolve()))))


class LoraBatch:
    """A step's rows grouped by adapter: (adapter, the rows' index) per adapter with rows in the step."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor]], gemm: Gemm) -> None:
        self.groups, self.gemm = groups, gemm

    @classmethod
    def of(cls, adapters: list[LoraAdapter | None], gemm: Gemm, device: torch.device) -> LoraBatch | None:
        """From each row's adapter (None: the base alone); None when no row has one."""
        rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for i, a in enumerate(adapters):
            if a is not None:
                rows.setdefault(id(a), (a, []))[1].append(i)
        if not rows:
            return None
        return cls([(a, torch.tensor(idx, dtype=torch.long, device=device)) for a, idx in rows.values()], gemm)

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows] += each adapter's update of projection `proj` in `layer` over x[rows], for its rows."""
        for adapter, idx in self.groups:
            d = adapter.layers[layer].get(proj)
            if d is None:
                continue
            xa = x.index_select(0, idx)
            y.index_add_(0, idx, self.gemm.linear(self.gemm.linear(xa, d.a), d.b))


class LoraManager:
    """The adapters resident in an engine, at most `max_loras`: one is loaded when a request names it (its files
    read and checked), and when all are resident the least recently used one no live request holds is evicted. A
    request whose adapter finds every resident one held waits (`LLMEngine` admits it once one frees)."""

    def __init__(self, dims: Dims, dtype: torch.dtype, device: torch.device, gemm: Gemm, max_loras: int,
                 max_rank: int) -> None:
        self.dims, self.dtype, self.device, self.gemm = dims, dtype, device, gemm
        self.max_loras, self.max_rank = max_loras, max_rank
        self.resident: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.held: dict[str, int] = {}  # name -> live requests holding it
        self.loads = self.evictions = 0

    def acquire(self, name: str, path: str) -> LoraAdapter | None:
        """The adapter, resident and held once more; None when it must wait (every resident one held);
        AdapterError when its files are bad."""
        a = self.resident.get(name)
        if a is not None and a.path != path:  # unloaded and loaded again from elsewhere: the new one
            if self.held.get(name):
                return None
            del self.resident[name]
            a = None
        if a is None:
            if len(self.resident) >= self.max_loras:
                victim = next((n for n in self.resident if not self.held.get(n)), None)
                if victim is None:
                    return None
                del self.resident[victim]
                self.evictions += 1
                log.info("LoRA adapter %s evicted (least recently used)", victim)
            a = LoraAdapter.load(name, path, self.dims, self.dtype, self.device, self.gemm, self.max_rank)
            self.loads += 1
            log.info("LoRA adapter %s loaded from %s", name, path)
            self.resident[name] = a
        self.resident.move_to_end(name)
        self.held[name] = self.held.get(name, 0) + 1
        return a

    def release(self, adapter: LoraAdapter) -> None:
        n = self.held.get(adapter.name, 0) - 1
        if n > 0:
            self.held[adapter.name] = n
        else:
            self.held.pop(adapter.name, None)
