"""The models a deployment serves, as `model` names them: the served model, and LoRA adapters on it, those of
LORA_MODULES and those loaded at run time into the registry (`conveyor:loras`, shared/lora.py). A request's
`model` resolves to the adapter it runs with (None: the served model alone), or answers 404 model_not_found."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aredis

from api.errors import ApiError
from shared import names
from shared.lora import AdapterError, Dims, LoraModule, check_adapter, check_name
from shared.model_config import model_context
from shared.settings import Settings
from shared.tenants import Tenant


def not_found(requested: str, settings: Settings) -> ApiError:
    return ApiError(404, f"the model '{requested}' does not exist; this server runs '{settings.served_model_name}' "
                         "and the adapters /v1/models lists", type_="model_not_found", param="model")


def _allowed(settings: Settings, requested: str | None, tenant: Tenant | None) -> str:
    """The name asked for (the served model's when none), 404 when the caller's key may not name it
    (`conveyor keys create --models`): to that key, a model it may not use does not exist."""
    name = requested or settings.served_model_name
    if tenant is not None and not tenant.may_use(name):
        raise not_found(name, settings)
    return name


async def resolve(redis: aredis.Redis, settings: Settings, requested: str | None,
                  tenant: Tenant | None = None) -> str | None:
    """The adapter `requested` names (None: the served model); 404 model_not_found for a name not served, or
    not to the caller's key."""
    name = _allowed(settings, requested, tenant)
    if name == settings.served_model_name:
        return None
    if name in settings.loras or await redis.hexists(names.LORAS, name):
        return name
    raise not_found(name, settings)


def resolve_static(settings: Settings, requested: str | None, tenant: Tenant | None = None) -> str | None:
    """`resolve` for the adapters of LORA_MODULES alone (a batch line, checked at upload)."""
    name = _allowed(settings, requested, tenant)
    if name == settings.served_model_name:
        return None
    if name in settings.loras:
        return name
    raise not_found(name, settings)


async def adapters(redis: aredis.Redis, settings: Settings) -> list[LoraModule]:
    """Every adapter served: LORA_MODULES', then those loaded at run time, by name."""
    loaded = [LoraModule.from_json(v) for v in (await redis.hgetall(names.LORAS)).values()]
    return [*settings.loras.values(), *sorted((m for m in loaded if m.name not in settings.loras),
                                              key=lambda m: m.name)]


async def listing(redis: aredis.Redis, settings: Settings, tenant: Tenant | None = None) -> list[dict[str, Any]]:
    """/v1/models' entries as vLLM shapes them: the served model (root: itself), then each adapter (root: its
    directory, parent: the served model); only those the caller's key may name."""
    base, context = settings.served_model_name, model_context(settings.model_path, settings.max_model_len)
    out = [{"id": base, "object": "model", "created": 0, "owned_by": "conveyor", "root": base, "parent": None,
            "max_model_len": context}]
    for m in await adapters(redis, settings):
        out.append({"id": m.name, "object": "model", "created": 0, "owned_by": "conveyor", "root": m.path,
                    "parent": base, "max_model_len": context})
    return [m for m in out if tenant is None or tenant.may_use(m["id"])]


async def load(redis: aredis.Redis, settings: Settings, name: str, path: str) -> None:
    """Register an adapter for every inference worker (each reads its files when a request first names it),
    after checking its files against the served model: 400 saying what does not fit."""
    try:
        check_name(name)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="lora_name") from None
    if name == settings.served_model_name or name in settings.loras or await redis.hexists(names.LORAS, name):
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    try:
        check_adapter(path, Dims.of(settings.model_path), settings.max_lora_rank)
    except (AdapterError, KeyError, ValueError) as exc:
        raise ApiError(400, f"the LoRA adapter '{name}' cannot be loaded: {exc}", param="lora_path") from None
    module = LoraModule(name, path, settings.served_model_name)
    if not await redis.hsetnx(names.LORAS, name, module.to_json()):
        raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")


async def unload(redis: aredis.Redis, settings: Settings, name: str) -> None:
    """Remove an adapter loaded at run time (one of LORA_MODULES stays: 400); 404 when none has the name. Jobs
    already queued for it fail at their worker."""
    if name in settings.loras:
        raise ApiError(400, f"the LoRA adapter '{name}' is one of LORA_MODULES: it cannot be unloaded",
                       param="lora_name")
    if not await redis.hdel(names.LORAS, name):
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", type_="not_found_error", param="lora_name")
