"""Where conveyor keeps its files on a host: the cache directory (CONVEYOR_CACHE: models, compiled kernels, the
embedded Redis's data) and the connection file that `conveyor up` leaves there for the commands run beside it
(`conveyor status`, `conveyor keys`): its Redis's URL and the settings every process of the stack must agree on.
It imports nothing of conveyor's: those commands read the file before shared.names reads REDIS_PARTITIONS."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONNECTION_FILE = "connection.json"  # in <cache>/redis
STACK_ENV = ("REDIS_PARTITIONS", "MODELS")  # what `conveyor up --redis-cluster N` and `--model` set for the stack


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "conveyor"


def cache_dir() -> Path:
    """CONVEYOR_CACHE, else the default (the Settings' `cache_dir`, read without them)."""
    return Path(os.environ.get("CONVEYOR_CACHE") or default_cache_dir())


def read_connection(cache: Path | str) -> dict[str, Any]:
    """The local stack's connection file ({"url", "password", "pid", ..., "env"}); {} when there is none (or it
    cannot be read)."""
    try:
        info = json.loads((Path(cache) / "redis" / CONNECTION_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def stack_env() -> dict[str, str]:
    """The STACK_ENV settings of this process, as the stack it starts records them in its connection file."""
    return {k: os.environ[k] for k in STACK_ENV if os.environ.get(k)}


def adopt_stack_env(cache: Path | str) -> None:
    """Take the local stack's STACK_ENV settings (from its connection file) where this process sets none, for a
    command that works on that stack from another shell."""
    env = read_connection(cache).get("env")
    for key, value in (env.items() if isinstance(env, dict) else ()):
        if key in STACK_ENV and isinstance(value, str) and not os.environ.get(key):
            os.environ[key] = value
