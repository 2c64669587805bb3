"""One Settings object, read from the environment (no prefix: REDIS_URL, MODEL, PORT, ...)."""

from __future__ import annotations

import ipaddress
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.lora import LoraModule, static_modules
from shared.model_config import ENGINE_ARCHS, model_config, whole_safetensors
from shared.paths import default_cache_dir
from shared.served import ServedModel, parse_models

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _require(path_text: str, weights: bool, what: str = "") -> str:
    """A model directory that holds what a worker loads (its tokenizer; its config and weights too, with `weights`),
    or SystemExit naming what is missing and how to get it."""
    path = Path(path_text)
    needed = ["tokenizer.json"] + (["config.json"] if weights else [])
    missing = [name for name in needed if not (path / name).is_file()]
    if weights and not missing and not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        missing.append("weights (*.safetensors)")
    if missing:
        raise SystemExit(f"{what}no model at {path} ({', '.join(missing)} missing): run `conveyor model pull` "
                         "(make run does), or set MODEL to a local model directory")
    if weights and (arch := model_config(str(path)).get("model_type")) not in ENGINE_ARCHS:
        raise SystemExit(f"{what}the model at {path} is a {arch!r} (config.json's model_type): the engine runs "
                         f"{', '.join(ENGINE_ARCHS)}")
    for part in sorted(path.glob("*.safetensors")) if weights else []:
        if not whole_safetensors(part):
            raise SystemExit(f"{what}the weights {part} are cut short or damaged: run `conveyor model pull` again "
                             "(the default model), or copy them again")
    return str(path)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", extra="ignore", protected_namespaces=())

    # where things live
    redis_url: str = Field("", description="Redis to use (one node, or any node of a Redis Cluster); empty means "
                                           "the supervisor starts its own")
    redis_partitions: int = Field(1, ge=1, le=256, description="hash-tagged partitions of the queue (shared/names.py "
                                  "reads it): 1 on one node; on a cluster a few per master (`conveyor up "
                                  "--redis-cluster N` sets 4N); every process must agree; it may grow, never shrink")
    celery_broker_url: str = Field("", description="Celery's broker: a single-node Redis; empty means REDIS_URL "
                                                   "(a Redis Cluster cannot be Celery's broker)")
    cache_dir: Path = Field(default_factory=default_cache_dir, validation_alias="CONVEYOR_CACHE")
    model: str = Field("", description="local model directory or hub id; empty means the first of MODELS, else "
                       "the default model")
    model_name: str = Field("", description="name reported by the API; defaults to the model dir's name")
    models: str = Field("", description="several models served, each with a queue and an inference pool of its own: "
                        "`name=path` items, or JSON objects {name, path, min_replicas, max_replicas}; the first is "
                        "the default; an inference worker serves the one MODEL_NAME names (shared/served.py)")

    # api/
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0: any free port (a single `conveyor api`)")
    default_max_tokens: int = 256
    max_tokens_cap: int = Field(4096, description="largest max_tokens a request may ask for")
    max_prompt_chars: int = Field(200_000, description="requests with more prompt text get 413")
    job_ttl_s: int = Field(24 * 3600, description="how long job records and event streams are kept, counted "
                           "afresh at each step a job takes (accepted, queued for an engine, started, first "
                           "output, every half TTL while it runs, ended)")
    idempotency_ttl_s: int = 24 * 3600
    batch_window_s: int = Field(24 * 3600, ge=1, description="how long a batch may run (its completion_window "
                                "'24h') before the unfinished lines end as batch_expired")
    sse_ping_s: float = Field(15.0, gt=0)
    sse_queue_size: int = 256

    # tenants and admission (see README, "Running it for others")
    auth: str = Field("", description="required | off; empty: off while HOST is a loopback address, else required")
    allow_insecure: bool = Field(False, description="let `conveyor up` serve a non-loopback HOST with auth off")
    internal_port: int = Field(0, ge=0, le=65535, description="port for /metrics, /scaling and /docs when auth is "
                               "required; 0: PORT + 1")
    internal_host: str = Field("127.0.0.1", description="address INTERNAL_PORT listens on: it answers without a key, "
                               "so loopback unless a network policy guards it (the Kubernetes manifests: 0.0.0.0)")
    max_queued: int = Field(10_000, ge=1, description="jobs waiting at once, service-wide, before submit answers 429")
    max_queue_wait_s: float = Field(300.0, gt=0, description="estimated wait past which submit answers 429")
    redis_maxmemory_mb: int = Field(1024, ge=16, description="maxmemory of the embedded redis-server (noeviction)")
    redis_appendfsync: Literal["always", "everysec"] = Field(
        "always", description="the embedded redis-server's append-only fsync: always (a write is on disk before "
                              "its reply, so a 202 survives kill -9 of Redis) or everysec (faster; the last "
                              "second of writes can be lost)")

    # workers/ tokenizer pool
    tokenizer_batch: int = Field(64, description="most jobs per Arrow record batch")
    tool_chat_template: str = Field("", description="the chat template a request with tools (or tool turns) is "
                                    "rendered with, a file: empty means the model's own when it renders tools, else "
                                    "the Hermes tool prompt shipped in workers/tokenizer/")
    tool_call_parser: Literal["hermes"] = Field("hermes", description="the format tool calls are read out of the "
                                                "output in (shared/tool_parsers/), as vLLM names its parsers")
    fair_share: bool = Field(True, description="tenants' jobs wait in queues of their own and the tenant with the "
                             "least weighted service goes next (shared/fair_queue.py); false: one queue, first "
                             "in, first out (by priority)")

    # gpu_worker/ engine
    engine: str = Field("torch", description="torch | synthetic (a zero-cost benchmark instrument)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$", description="auto | cpu | cuda | cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto | float32 | bfloat16 | float16; auto: bfloat16 on CUDA and on "
                       "CPUs with native bfloat16 (AVX512-BF16, AMX), else float32")
    stream_interval: int = Field(1, ge=1, description="tokens per streamed chunk after the first; more means "
                                 "fewer events for the output lane, Redis, the API and clients to handle")
    max_num_seqs: int = Field(64, ge=1, description="most sequences running at once")
    max_num_batched_tokens: int = Field(0, ge=0, description="most tokens per step (decode + prefill chunks); "
                                                       "0: 256 on CPU, 2048 on CUDA")
    admit_every_steps: int = Field(4, ge=1, le=64, description="while requests decode, waiting prompts start "
                                   "together on every Nth step at most: fewer decode steps carry a prompt's chunk "
                                   "(ITL), each new prompt waits up to N - 1 steps more (TTFT); 1: every step")
    kv_cache_mb: int = Field(2048, ge=1, description="KV-cache pool, in blocks of kv_block_size tokens; when no "
                             "block is free the newest request is preempted")
    kv_block_size: int = Field(16, ge=1, le=1024, description="tokens per KV-cache block")
    prefix_caching: bool = Field(True, description="reuse the KV blocks of prompt prefixes seen before")
    max_model_len: int = Field(4096, ge=0, description="context cap; 0 means the model's own")
    speculative: Literal["", "ngram"] = Field("", description="speculative decoding: ngram (draft tokens from the "
                                              "sequence's own earlier text, each kept only where sampling draws it "
                                              "anyway: outputs unchanged) or empty (off)")
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="draft tokens at most per sequence and step")
    prompt_lookup_min: int = Field(2, ge=1, description="shortest suffix n-gram looked up (SPECULATIVE=ngram)")
    prompt_lookup_max: int = Field(4, ge=1, description="longest suffix n-gram looked up (SPECULATIVE=ngram)")
    cpu_kernels: bool = Field(True, description="on CPU, the engine's kernels compiled on first use (g++): decode "
                              "attention read from the KV cache in place, fused layer steps; off, or without a "
                              "compiler: torch ops only (K/V gathered for SDPA)")
    cpu_gemm: Literal["packed", "onednn"] = Field("packed", description="on CPU, with CPU_KERNELS, the linear "
                                                  "layers' matrix products: `packed`, the engine's own kernel on a "
                                                  "pool of threads that share its work a chunk at a time (float32 "
                                                  "with AVX512F, bfloat16 with AVX512-BF16; elsewhere oneDNN), or "
                                                  "`onednn`, torch's oneDNN on OpenMP's threads")
    lora_modules: str = Field("", description="LoRA adapters served, in vLLM's forms: `name=path` items, or JSON "
                              "objects {name, path, base_model_name}; each is named in `model` like a model")
    max_loras: int = Field(4, ge=1, le=64, description="LoRA adapters resident in an inference worker at once (so "
                           "in one step); least recently used evicted")
    max_lora_rank: int = Field(16, ge=1, le=512, description="highest LoRA rank served (vLLM's default): every "
                               "resident adapter takes a slot this wide in each projection's stack")
    allow_runtime_lora_updating: bool = Field(False, description="POST /v1/load_lora_adapter and "
                                              "/v1/unload_lora_adapter (where keys are required, on the internal "
                                              "port only, unauthenticated: the operator's, as /metrics)")
    torch_threads: int = Field(0, ge=0)
    grammar_warm: bool = Field(False, description="load xgrammar and the tokenizer's description for it when a "
                               "worker starts (the tokenizer's compiler child, the inference worker's loader) rather "
                               "than when the first structured-output request arrives, which otherwise waits for "
                               "them (~5 s on 2 cores); costs each worker that memory whether grammars come or not")
    cpu_bind_threads: bool = Field(False, description="on a CPU host that runs one inference worker: its compute "
                                   "threads bound one to a core (OMP_PROC_BIND=true, OMP_PLACES=cores; an operator's "
                                   "own OMP_* win); off: the OS places them, as several workers on one host need. "
                                   "`conveyor up` sets it when unset and its pools hold one inference worker at most")

    # reliability
    claim_idle_ms: int = Field(30_000, description="pending entries idle this long are taken from dead consumers")
    refresh_s: float = Field(5.0, description="how often a worker marks its in-flight entries as alive")
    webhook_timeout_s: float = Field(5.0, gt=0, description="how long a job's webhook may take to answer")
    webhook_retry_s: float = Field(10.0, ge=0, description="wait before a failed webhook is tried again, doubling "
                                   "after each further failure up to WEBHOOK_RETRY_MAX_S")
    webhook_retry_max_s: float = Field(3600.0, ge=0, description="the longest wait between two tries of a webhook")
    webhook_attempts: int = Field(16, ge=1, description="tries of a webhook before it goes to the dead-letter stream "
                                  "(16 with the defaults: the last some 8 hours after the job ended)")
    webhook_secret: str = Field("", description="when set, webhooks carry X-Conveyor-Signature (HMAC-SHA256); "
                                "a job submitted with an API key is signed with that key's own secret instead")
    webhook_allow_private: bool = Field(False, description="let webhooks reach loopback and private addresses "
                                        "(local development only)")
    webhook_ports: str = Field("", pattern=r"^\s*(\d{1,5}\s*(,\s*\d{1,5}\s*)*)?$",
                               description="the ports a webhook_url may name, comma-separated (empty: any): those the "
                               "network lets the Celery worker reach (infra/k8s: 80,443). A URL with another port is "
                               "refused when submitted (422), and not sent if it was accepted before")
    delivery_limit: int = Field(3, description="deliveries before an entry goes to the dead-letter stream")
    heartbeat_s: float = 5.0
    write_outage_s: float = Field(30.0, gt=0, description="an inference worker whose output lane has failed to "
                                  "write for this long withholds its heartbeat (readiness and the autoscaler see "
                                  "it gone) until a write goes through")
    drain_grace_s: float = 30.0

    # local autoscaler (infra/autoscale.py); the pools' bounds come from `conveyor up`
    autoscale_period_s: float = 5.0
    tokenizer_max: int = 4
    inference_max: int = 1
    inference_min: int = Field(1, ge=0, description="inference processes kept while idle (`conveyor up --inference` "
                               "sets it): 0 scales the pool to zero once idle for SCALE_IN_COOLDOWN_S; a job then "
                               "waits, queued, while the supervisor (or KEDA) starts a worker")
    tokenizer_lag_per_replica: int = 64
    inference_lag_per_replica: int = 64
    scale_in_cooldown_s: float = Field(0.0, description="0 keeps each pool's default (60 s / 300 s)")

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.engine not in ("torch", "synthetic"):
            raise ValueError("ENGINE must be 'torch' or 'synthetic'")
        if self.auth not in ("", "required", "off"):
            raise ValueError("AUTH must be 'required' or 'off'")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("PROMPT_LOOKUP_MIN must be at most PROMPT_LOOKUP_MAX")
        if self.max_tokens_cap < 1 or self.default_max_tokens > self.max_tokens_cap:
            raise ValueError("DEFAULT_MAX_TOKENS must be between 1 and MAX_TOKENS_CAP")
        if self.models and self.served_model_name not in self.served:
            raise ValueError(f"MODEL_NAME {self.served_model_name!r} is not one of MODELS ({', '.join(self.served)})")
        for m in self.loras.values():
            if m.base_model_name not in self.served:
                raise ValueError(f"LORA_MODULES: {m.name}'s base_model_name {m.base_model_name!r} is not a model "
                                 f"served ({', '.join(self.served)})")
            if m.name in self.served:
                raise ValueError(f"LORA_MODULES: {m.name!r} is a served model's own name")
        return self

    @cached_property
    def loras(self) -> dict[str, LoraModule]:
        """The adapters LORA_MODULES names, by name (ValueError for a malformed value); `name=path` items are on
        the default model."""
        return static_modules(self.lora_modules, self.default_model)

    @cached_property
    def _listed(self) -> list[ServedModel]:
        return parse_models(self.models)

    @cached_property
    def served(self) -> dict[str, ServedModel]:
        """The models served, by name, the default first: MODELS', else the one MODEL names."""
        return ({m.name: m for m in self._listed} if self._listed
                else {self.served_model_name: ServedModel(self.served_model_name, self.model_path)})

    @field_validator("webhook_ports")
    @classmethod
    def _ports(cls, value: str) -> str:
        if any(not 1 <= int(p) <= 65535 for p in value.split(",") if p.strip()):
            raise ValueError(f"WEBHOOK_PORTS: ports are between 1 and 65535; got {value!r}")
        return value

    @property
    def webhook_port_set(self) -> frozenset[int]:
        """WEBHOOK_PORTS as ports (empty: any)."""
        return frozenset(int(p) for p in self.webhook_ports.split(",") if p.strip())

    @property
    def default_model(self) -> str:
        """The model a request that names none runs on: the first served."""
        return next(iter(self.served))

    def key_of(self, model: str | None) -> str:
        """A served model's queue name (shared/names.py `model_prefix`): '' for the default model."""
        return "" if model is None or model == self.default_model else model

    @property
    def model_key(self) -> str:
        """This process's model's queue name (an inference worker's: the model MODEL_NAME names)."""
        return self.key_of(self.served_model_name)

    @property
    def model_keys(self) -> list[str]:
        """Every served model's queue name, the default's ('') first."""
        return [self.key_of(name) for name in self.served]

    def path_of(self, model: str | None) -> str:
        """A served model's directory (None: the default model's)."""
        return self.served[model or self.default_model].path

    def bounds_of(self, model: str) -> tuple[int, int]:
        """A served model's inference pool bounds: its own in MODELS, else INFERENCE_MIN and INFERENCE_MAX."""
        m = self.served[model]
        low = self.inference_min if m.min_replicas is None else m.min_replicas
        return low, max(low, self.inference_max if m.max_replicas is None else m.max_replicas)

    @property
    def auth_required(self) -> bool:
        """AUTH=required|off; unset, keys are required unless the API listens on a loopback address only."""
        return self.auth == "required" or (self.auth == "" and not is_loopback(self.host))

    @property
    def internal_port_number(self) -> int:
        return self.internal_port or self.port + 1

    @property
    def model_path(self) -> str:
        """This process's model's directory: MODEL, else the first of MODELS', else the default model's."""
        if self.model:
            return self.model
        return self._listed[0].path if self._listed else str(self.cache_dir / "models" / DEFAULT_MODEL_NAME)

    def require_model(self, weights: bool = True) -> str:
        """The local model directory, or exit saying what to do: a worker started without its model
        would otherwise die on a bare file-not-found (or an attempt to reach a model hub)."""
        return _require(self.model_path, weights)

    def require_models(self) -> None:
        """Every served model's directory whole (`conveyor up`: a model without its weights would take jobs that
        wait for good while its workers fail to start, again and again), or exit saying which and what to do."""
        for m in self.served.values():
            _require(m.path, self.engine != "synthetic", f"MODELS: {m.name}: ")

    @cached_property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.model:
            return Path(self.model_path).name
        return self._listed[0].name if self._listed else DEFAULT_MODEL_NAME

    @property
    def redis_data_dir(self) -> Path:
        return self.cache_dir / "redis"


@lru_cache
def get_settings() -> Settings:
    return Settings()
