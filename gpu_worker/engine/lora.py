"""LoRA adapters in the engine: their weights as the model's fused projections take them, the slots they are resident
in (at most MAX_LORAS, least recently used evicted), and a step's rows under them.

A PEFT adapter changes a projection W to W + s * B @ A (A [r, in], B [out, r], s its scaling: alpha / r, or
alpha / sqrt(r) with rsLoRA). The model fuses q/k/v and gate/up into one matrix each (models/llama.py), so an
adapter's parts are fused the same way: their A stacked ([r_q + r_k + r_v, in]), their B block-diagonal with the
scaling folded in ([out_q + out_k + out_v, r_q + r_k + r_v]); a part the adapter leaves alone is a zero block.

Resident adapters sit in fixed slots of one zero-padded stack per layer and projection, as vLLM's punica kernels
hold them: MAX_LORAS slots of (parts x MAX_LORA_RANK) columns each. A step with adapter rows computes, per
projection, every row against every slot at once (x @ A_all.T), zeroes each row's columns outside its own slot (one
mask a step), and adds (. @ B_all.T) onto the projection's output in the same GEMM call: three calls whatever the
number of adapters in the step. On these CPUs a GEMM call's fixed cost dominates at LoRA's shapes (~25-35 us for
576 -> 48 at 32 rows), so grouping rows per adapter (two GEMMs, a gather and a scatter each) cost 4x this with four
adapters (BENCHMARKS.md, "LoRA"). The GEMMs are the base's own backend (gemm.py), whose bits for a row do not depend
on the other rows; the stacks' shapes are fixed, and a row's update reads only its own slot (the rest are exact
zeros): an adapter row's tokens do not depend on what shares its steps, nor on its slot (`test_lora.py`). A row
without an adapter gets an exact zero added (its bits unchanged); a step in which no row has one runs the base path
alone.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file

from gpu_worker.engine.gemm import Gemm
from shared.lora import CONFIG_FILE, KEY, WEIGHTS_FILE, AdapterError, Dims, check_adapter

log = logging.getLogger("conveyor.engine")

FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


def files_stamp(path: str) -> tuple[int, ...]:
    """When and how large an adapter's files are (its config and weights): what tells files written anew."""
    out: list[int] = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (Path(path) / name).stat()
            out += [st.st_mtime_ns, st.st_size]
        except OSError:
            out += [0, 0]
    return tuple(out)


class LoraAdapter:
    """An adapter's weights, per layer its fused (A, B) per projection it changes, in float32 as read; `slot` its
    place in the resident stacks while it is resident."""

    def __init__(self, name: str, path: str, layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        self.name, self.path, self.layers = name, path, layers
        self.slot = -1
        self.stamp = files_stamp(path)  # its files as read: files changed since (retrained) are another adapter
        # seeds its sequences' prefix-cache hashes
        self.salt = hash(("lora", name, str(Path(path).resolve()), self.stamp))

    @classmethod
    def load(cls, name: str, path: str, dims: Dims, max_rank: int) -> LoraAdapter:
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
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for li in range(dims.layers):
            fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for proj, modules in FUSED.items():
                ranks = [info.ranks.get((li, mod), 0) for mod in modules]
                if not any(ranks):
                    continue
                width, cols, a_parts, b_blocks = sum(ranks), 0, [], []
                for mod, r in zip(modules, ranks):
                    block = torch.zeros(dims.shapes[mod][0], width)
                    if r:
                        a_parts.append(parts[(li, mod)]["A"])
                        block[:, cols : cols + r] = parts[(li, mod)]["B"] * info.scaling[(li, mod)]
                        cols += r
                    b_blocks.append(block)
                fused[proj] = (torch.cat(a_parts), torch.cat(b_blocks))
            layers.append(fused)
        return cls(name, path, layers)


class LoraStacks:
    """The resident adapters' weights, per layer and projection one zero-padded stack over the slots: A_all
    [slots * width, in] and B_all [out, slots * width] (width: the projection's parts x the largest rank), kept as
    written (to write a slot) and as the GEMM backend prepared them."""

    def __init__(self, dims: Dims, slots: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 gemm: Gemm) -> None:
        self.dims, self.slots, self.gemm = dims, slots, gemm
        self.width = {proj: len(mods) * max_rank for proj, mods in FUSED.items()}
        self.raw: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        self.prepared: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in range(dims.layers):
            raw = {}
            for proj, mods in FUSED.items():
                out_dim, in_dim = sum(dims.shapes[m][0] for m in mods), dims.shapes[mods[0]][1]
                cols = slots * self.width[proj]
                raw[proj] = (torch.zeros(cols, in_dim, dtype=dtype, device=device),
                             torch.zeros(out_dim, cols, dtype=dtype, device=device))
            self.raw.append(raw)
            self.prepared.append({p: (gemm.prepare(a), gemm.prepare(b)) for p, (a, b) in raw.items()})
        self.columns = {p: torch.arange(slots * w, device=device) // w for p, w in self.width.items()}  # col -> slot

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Put the adapter's weights in `slot` (None: zeros), every layer and projection prepared again."""
        with torch.no_grad():
            for li, raw in enumerate(self.raw):
                for proj, (a_all, b_all) in raw.items():
                    w = self.width[proj]
                    at = slot * w
                    a_all[at : at + w].zero_()
                    b_all[:, at : at + w].zero_()
                    own = adapter.layers[li].get(proj) if adapter is not None else None
                    if own is not None:
                        a, b = own
                        a_all[at : at + a.shape[0]] = a
                        b_all[:, at : at + b.shape[1]] = b
                    self.prepared[li][proj] = (self.gemm.prepare(a_all), self.gemm.prepare(b_all))


class LoraBatch:
    """A step's rows under adapters: per projection, the mask [rows, slots * width] that keeps each row's own slot's
    columns (all zero for a row without an adapter)."""

    def __init__(self, stacks: LoraStacks, masks: dict[str, torch.Tensor]) -> None:
        self.stacks, self.masks = stacks, masks

    @classmethod
    def of(cls, stacks: LoraStacks, adapters: list[LoraAdapter | None], dtype: torch.dtype,
           device: torch.device) -> LoraBatch | None:
        """From each row's adapter (None: the base alone); None when no row has one."""
        if all(a is None for a in adapters):
            return None
        slot = torch.tensor([a.slot if a is not None else -1 for a in adapters], device=device)
        return cls(stacks, {p: (slot[:, None] == cols[None, :]).to(dtype) for p, cols in stacks.columns.items()})

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's adapter's update of projection `proj` in `layer` over its x (a new tensor)."""
        a_all, b_all = self.stacks.prepared[layer][proj]
        gemm = self.stacks.gemm
        return gemm.linear_add(gemm.linear(x, a_all).mul_(self.masks[proj]), b_all, y)


class LoraManager:
    """The adapters resident in an engine, at most `max_loras` (its slots): one is loaded when a request names it
    (its files read and checked), and when every slot is taken the least recently used adapter no live request holds
    is evicted. A request whose adapter finds every resident one held waits (`LLMEngine` admits it once one frees)."""

    def __init__(self, dims: Dims, dtype: torch.dtype, device: torch.device, gemm: Gemm, max_loras: int,
                 max_rank: int) -> None:
        self.dims, self.dtype, self.device = dims, dtype, device
        self.max_loras, self.max_rank = max_loras, max_rank
        self.stacks = LoraStacks(dims, max_loras, max_rank, dtype, device, gemm)
        self.resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.held: dict[str, int] = {}  # name -> live requests holding it
        self.loads = self.evictions = 0

    def acquire(self, name: str, path: str) -> LoraAdapter | None:
        """The adapter, resident and held once more; None when it must wait (every resident one held);
        AdapterError when its files are bad."""
        a = self.resident.get(name)
        if a is not None and (a.path != path or a.stamp != files_stamp(path)):  # loaded again from elsewhere, or
            # its files written anew (a retrained adapter unloaded and loaded again): the new one
            if self.held.get(name):
                return None
            self._evict(name)
            a = None
        if a is None:
            free = set(range(self.max_loras)) - {r.slot for r in self.resident.values()}
            if not free:
                victim = next((n for n in self.resident if not self.held.get(n)), None)
                if victim is None:
                    return None
                free = {self._evict(victim)}
                self.evictions += 1
                log.info("LoRA adapter %s evicted (least recently used)", victim)
            a = LoraAdapter.load(name, path, self.dims, self.max_rank)
            a.slot = min(free)
            self.stacks.write(a.slot, a)
            self.loads += 1
            log.info("LoRA adapter %s loaded from %s into slot %d", name, path, a.slot)
            self.resident[name] = a
        self.resident.move_to_end(name)
        self.held[name] = self.held.get(name, 0) + 1
        return a

    def _evict(self, name: str) -> int:
        """Forget a resident adapter and answer its slot. Its weights stay there until the next adapter is written
        over them: no row reads a slot that is not its own adapter's (the batch's masks), and writing zeros would
        cost a reorder of every stack (~80 ms for the default model) in the engine's loop, every row waiting."""
        return self.resident.pop(name).slot

    def release(self, adapter: LoraAdapter) -> None:
        n = self.held.get(adapter.name, 0) - 1
        if n > 0:
            self.held[adapter.name] = n
        else:
            self.held.pop(adapter.name, None)

    def batch(self, adapters: list[LoraAdapter | None]) -> LoraBatch | None:
        return LoraBatch.of(self.stacks, adapters, self.dtype, self.device)
