"""The models a deployment serves, as `model` names them: the served models (MODELS, shared/served.py), and LoRA
adapters on them, those of LORA_MODULES and those loaded at run time into the registry (`conveyor:loras`,
shared/lora.py). A request's `model` resolves to a `Target` (the model it runs on and the adapter it runs with), or
answers 404 model_not_found."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis

from api.errors import ApiError
from shared import names
from shared.lora import AdapterError, Dims, LoraModule, check_adapter, check_name
from shared.model_config import model_context
from shared.schemas import GenerationRequest
from shared.settings import Settings
from shared.tenants import Tenant

# what checking an adapter's files raises when it cannot be served: AdapterError saying why, and a config or header
# of the wrong shapes (`r: {}`, `rank_pattern: ["x"]`, a pattern that is no regex, ...) or unreadable files
NOT_SERVABLE = (AdapterError, KeyError, ValueError, TypeError, AttributeError, OSError, re.error)


def not_found(requested: str, settings: Settings, tenant: Tenant | None = None) -> ApiError:
    """404 naming the models the caller may use (a key limited to some: those only), in OpenAI's shape: type
    `invalid_request_error`, code `model_not_found`."""
    runs = ", ".join(repr(m) for m in settings.served if tenant is None or tenant.may_use(m)) or "no model"
    whose = " for this key" if tenant is not None and tenant.models else ""
    return ApiError(404, f"the model '{requested}' does not exist; this server runs {runs}{whose} and the adapters "
                         "/v1/models lists", type_="invalid_request_error", param="model", code="model_not_found")


@dataclass(frozen=True)
class Target:
    """What a request's `model` names: the served model it runs on (its queue and pool), and the adapter on it
    (None: the model alone)."""
    model: str
    adapter: str | None = None

    def apply(self, req: GenerationRequest, settings: Settings) -> GenerationRequest:
        """Name them on the request as the stages read it: `model` the adapter, `base_model` the model when it is
        not the default (its queue, shared/served.py)."""
        req.model, req.base_model = self.adapter, settings.key_of(self.model) or None
        return req

    def key(self, settings: Settings) -> str | None:
        """The model's queue name, None the default's (as `GenerationRequest.base_model` and `TokenizeCall` take it)."""
        return settings.key_of(self.model) or None


def _allowed(settings: Settings, requested: str | None, tenant: Tenant | None) -> str:
    """The name asked for (the default model's when none), 404 when the caller's key may not name it
    (`conveyor keys create --models`): to that key, a model it may not use does not exist."""
    name = requested or settings.default_model
    if tenant is not None and not tenant.may_use(name):
        raise not_found(name, settings, tenant)
    return name


def _static(settings: Settings, name: str) -> Target | None:
    if name in settings.served:
        return Target(name)
    if name in settings.loras:
        return Target(settings.loras[name].base_model_name, name)
    return None


async def resolve(redis: aredis.Redis, settings: Settings, requested: str | None,
                  tenant: Tenant | None = None) -> Target:
    """The model and adapter `requested` names (None: the default model); 404 model_not_found for a name not
    served, or not to the caller's key."""
    name = _allowed(settings, requested, tenant)
    target = _static(settings, name)
    if target is None and (raw := await redis.hget(names.LORAS, name)):
        module = LoraModule.from_json(raw)
        if module.base_model_name in settings.served:
            target = Target(module.base_model_name, name)
    if target is None:
        raise not_found(name, settings, tenant)
    return target


def resolve_static(settings: Settings, requested: str | None, tenant: Tenant | None = None,
                   loaded: dict[str, LoraModule] | None = None) -> Target:
    """`resolve` without a read of Redis (a batch's lines, checked at upload): the models, the adapters of
    LORA_MODULES and those of `loaded` (the runtime adapters, read once for all the lines: `runtime_adapters`)."""
    name = _allowed(settings, requested, tenant)
    target = _static(settings, name)
    module = (loaded or {}).get(name)
    if target is None and module is not None and module.base_model_name in settings.served:
        target = Target(module.base_model_name, name)
    if target is None:
        raise not_found(name, settings, tenant)
    return target


async def runtime_adapters(redis: aredis.Redis) -> dict[str, LoraModule]:
    """The adapters loaded at run time, by name."""
    return {m.name: m for m in map(LoraModule.from_json, (await redis.hgetall(names.LORAS)).values())}


async def adapters(redis: aredis.Redis, settings: Settings) -> list[LoraModule]:
    """Every adapter served: LORA_MODULES', then those loaded at run time, by name."""
    loaded = (await runtime_adapters(redis)).values()
    return [*settings.loras.values(), *sorted((m for m in loaded if m.name not in settings.loras),
                                              key=lambda m: m.name)]


async def listing(redis: aredis.Redis, settings: Settings, tenant: Tenant | None = None) -> list[dict[str, Any]]:
    """/v1/models' entries as vLLM shapes them: each served model (root: itself), the default first, then each
    adapter (root: its directory, parent: its model); only those the caller's key may name."""
    context = {m.name: model_context(m.path, settings.max_model_len) for m in settings.served.values()}
    out: list[dict[str, Any]]
    out = [{"id": name, "object": "model", "created": 0, "owned_by": "conveyor", "root": name, "parent": None,
            "max_model_len": n} for name, n in context.items()]
    for m in await adapters(redis, settings):
        if m.base_model_name in context:
            out.append({"id": m.name, "object": "model", "created": 0, "owned_by": "conveyor", "root": m.path,
                        "parent": m.base_model_name, "max_model_len": context[m.base_model_name]})
    return [m for m in out if tenant is None or tenant.may_use(m["id"])]


async def load(redis: aredis.Redis, settings: Settings, name: str, path: str, base: str | None = None,
               inplace: bool = False) -> None:
    """Register an adapter of `base` (a served model; None the default) for its inference workers (each reads its
    files when a request first names it), after checking its files against that model: 400 saying what does not
    fit. `inplace` (vLLM's `load_inplace`): an adapter loaded at run time under this name is replaced (its workers
    load the new files for the jobs they start from then on; those running keep the old)."""
    try:
        check_name(name)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="lora_name") from None
    if not os.path.isabs(path):  # the API's and the workers' working directories need not be the same
        raise ApiError(400, f"lora_path must be an absolute path; got '{path}'", param="lora_path")
    base = base or settings.default_model
    if base not in settings.served:
        raise ApiError(400, f"the base model '{base}' is not served", param="base_model_name")
    if name in settings.served:
        raise ApiError(400, f"'{name}' is a served model's name; an adapter needs a name of its own",
                       param="lora_name")
    if name in settings.loras:
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded (LORA_MODULES: it cannot be "
                       "replaced)." if inplace else f"The lora adapter '{name}' has already been loaded.",
                       param="lora_name")
    if not inplace and await redis.hexists(names.LORAS, name):
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    try:
        check_adapter(path, Dims.of(settings.path_of(base)), settings.max_lora_rank)
    except NOT_SERVABLE as exc:
        raise ApiError(400, f"the LoRA adapter '{name}' cannot be loaded: {type(exc).__name__}: {exc}",
                       param="lora_path") from None
    module = LoraModule(name, path, base)
    if inplace:
        await redis.hset(names.LORAS, name, module.to_json())
    elif not await redis.hsetnx(names.LORAS, name, module.to_json()):
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")


def check_static(settings: Settings) -> None:
    """Every adapter LORA_MODULES names checked against its model, as a runtime load is (SystemExit saying which
    and why): one that cannot be served would otherwise be listed, take jobs, and fail each on a worker."""
    for m in settings.loras.values():
        base = m.base_model_name or settings.default_model
        try:
            check_adapter(m.path, Dims.of(settings.path_of(base)), settings.max_lora_rank)
        except NOT_SERVABLE as exc:
            raise SystemExit(f"LORA_MODULES: the adapter '{m.name}' at {m.path} cannot be served: "
                             f"{type(exc).__name__}: {exc}") from None


async def unload(redis: aredis.Redis, settings: Settings, name: str) -> None:
    """Remove an adapter loaded at run time (one of LORA_MODULES stays: 400); 404 when none has the name. Jobs
    already queued for it fail at their worker."""
    if name in settings.loras:
        raise ApiError(400, f"the LoRA adapter '{name}' is one of LORA_MODULES: it cannot be unloaded",
                       param="lora_name")
    if not await redis.hdel(names.LORAS, name):
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", type_="not_found_error", param="lora_name")
