"""vLLM's run-time LoRA endpoints, when ALLOW_RUNTIME_LORA_UPDATING is on (else 404, as vLLM without
VLLM_ALLOW_RUNTIME_LORA_UPDATING): POST /v1/load_lora_adapter and /v1/unload_lora_adapter. Where keys are required
they answer on the internal port only (api/guard.py), as /metrics and /scaling do. An adapter loaded is served by
every worker of the deployment (the registry, shared/lora.py), each reading its files when a request first names it:
its path must be readable where the API and the inference workers run."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from api import models as served
from api.deps import RedisDep, SettingsDep
from api.errors import ApiError

router = APIRouter(prefix="/v1", tags=["lora"])


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)  # absolute, readable where the API and the workers run
    load_inplace: bool = False  # vLLM's: replace the adapter loaded at run time under this name
    # the served model it adapts (MODELS, shared/served.py); none: the default model
    base_model_name: str | None = Field(None, min_length=1, max_length=64)


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=128)


def _enabled(settings: SettingsDep) -> None:
    if not settings.allow_runtime_lora_updating:
        raise ApiError(404, "loading LoRA adapters at run time is off (ALLOW_RUNTIME_LORA_UPDATING)",
                       type_="not_found_error")


@router.post("/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapter, redis: RedisDep, settings: SettingsDep) -> str:
    """Serve a PEFT LoRA adapter of the served model under `lora_name`, checked from its files first."""
    _enabled(settings)
    await served.load(redis, settings, body.lora_name, body.lora_path, body.base_model_name, body.load_inplace)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapter, redis: RedisDep, settings: SettingsDep) -> str:
    """Stop serving an adapter loaded at run time."""
    _enabled(settings)
    await served.unload(redis, settings, body.lora_name)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
