"""The local Phoenix process: Arize Phoenix as the stack's trace UI and OTLP/HTTP receiver (`conveyor up --traces`).

Phoenix lives in a virtual environment of its own (`make phoenix`: `.cache/phoenix-venv`, about 850 MB that the
project's own environment and image do without), or anywhere on PATH. It serves its UI, its REST and GraphQL
APIs and OTLP/HTTP (`/v1/traces`) on one port, keeps its traces in SQLite under its working directory, and
reaches nothing on the internet: telemetry, web fonts, its LLM chat and its MCP server are off. It listens on
loopback only, since it has no authentication; it also opens OTLP/gRPC, on the next port up (never used here).

Every process of the stack exports to it by OpenTelemetry's own settings (`otel_env`, shared/tracing.py), into
the Phoenix project `conveyor` (the resource attribute `openinference.project.name`). A trace's page is
`trace_url(base, trace_id)`: Phoenix redirects it to `/projects/<project id>/traces/<trace id>`.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

DEFAULT_PORT = 6006
HOST = "127.0.0.1"
PROJECT = "conveyor"
VENV = Path(__file__).resolve().parents[1] / ".cache" / "phoenix-venv"
MISSING = ("Phoenix (arize-phoenix) is not installed: `make phoenix` installs it in .cache/phoenix-venv "
           "(python3.11 -m venv .cache/phoenix-venv && .cache/phoenix-venv/bin/pip install arize-phoenix==20.26.1), "
           "or put a `phoenix` executable on PATH")


def find_phoenix() -> str | None:
    """The `phoenix` executable: .cache/phoenix-venv's, else the first on PATH; None when there is none."""
    local = VENV / "bin" / "phoenix"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("phoenix")


def require_phoenix() -> str:
    """The `phoenix` executable, or exit saying how to install it."""
    exe = find_phoenix()
    if exe is None:
        raise SystemExit(MISSING)
    return exe


def grpc_port(port: int) -> int:
    """Phoenix always opens OTLP/gRPC too; on the port after its own, not 4317, which a collector may hold."""
    return port + 1


def phoenix_command(port: int, workdir: Path, exe: str | None = None) -> list[str]:
    """The command that runs Phoenix in the foreground (its settings are in `phoenix_env`)."""
    return [exe or require_phoenix(), "serve", "--host", HOST, "--port", str(port), "--grpc-port", str(grpc_port(port))]


def phoenix_env(port: int, workdir: Path, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Phoenix's environment: `base` without OpenTelemetry's settings (those are for the stack's processes, not
    for Phoenix's own client code), its port, host and working directory (its SQLite database, phoenix.db, unless
    `base` names another in PHOENIX_SQL_DATABASE_URL), and nothing that reaches the internet."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in base.items() if not k.startswith("OTEL_")}
    env.update({
        "PHOENIX_PORT": str(port),
        "PHOENIX_HOST": HOST,
        "PHOENIX_GRPC_PORT": str(grpc_port(port)),
        "PHOENIX_WORKING_DIR": str(workdir),
        "PHOENIX_TELEMETRY_ENABLED": "false",  # no FullStory or Scarf pixels in the UI
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",  # no web fonts, no sandbox download, nothing fetched
        "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",  # its chat, which calls hosted LLMs
        "PHOENIX_AGENTS_DISABLE_BASH": "true",
        "PHOENIX_ENABLE_MCP_SERVER": "false",
    })
    env.setdefault("PHOENIX_LOGGING_LEVEL", "warning")  # not a line per span batch received
    env.setdefault("PHOENIX_LOG_MIGRATIONS", "false")
    env["PYTHONWARNINGS"] = "ignore"  # its SQLAlchemy warnings at each start
    return env


def endpoint(port: int, host: str = HOST) -> str:
    """What OTEL_EXPORTER_OTLP_ENDPOINT is set to: the OTLP/HTTP exporter appends /v1/traces to it."""
    return f"http://{host}:{port}"


def ui_url(port: int, host: str = HOST) -> str:
    return f"http://{host}:{port}"


def trace_url(base: str, trace_id: str) -> str:
    """A trace's page in Phoenix's UI, by its OpenTelemetry id (32 hex digits)."""
    return f"{base.rstrip('/')}/redirects/traces/{trace_id.lower()}"


def otel_env(url: str, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The OpenTelemetry settings that send a process's traces to the OTLP/HTTP receiver at `url` (an endpoint
    without /v1/traces), into the Phoenix project `conveyor`; to merge into every child's environment. Traces are
    turned on even if `base` turned them off, and a traces-only endpoint in `base` is replaced."""
    attrs = [a for a in base.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
             if a.strip() and not a.strip().startswith("openinference.project.name=")]
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": url.rstrip("/"),
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": url.rstrip("/") + "/v1/traces",  # signal-specific: used as is
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_SDK_DISABLED": "false",
        "OTEL_SERVICE_NAME": base.get("OTEL_SERVICE_NAME") or "conveyor",
        "OTEL_RESOURCE_ATTRIBUTES": ",".join([*attrs, f"openinference.project.name={PROJECT}"]),
    }


def ready(port: int, host: str = HOST) -> bool:
    """Whether Phoenix answers its health check."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def wait_ready(port: int, timeout: float = 90.0, host: str = HOST, stop: threading.Event | None = None) -> bool:
    """Wait for Phoenix to answer (it starts in some seconds; its first start creates its database), until
    `timeout` or `stop` is set."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        if ready(port, host):
            return True
        if stop is not None:
            stop.wait(0.5)
        else:
            time.sleep(0.5)
    return False
