"""The isolation zones hold: the API never imports torch or a tokenizer; the tokenizer pool no torch."""

from __future__ import annotations

import functools
import subprocess
import sys

from tests.conftest import ROOT

# no Redis answers there: importing needs none. The Celery broker is named apart from REDIS_URL so that
# workers.celery_app does not wait (10 s) for that Redis to say whether it is a cluster
ENV = {"PATH": "/usr/bin:/bin", "REDIS_URL": "redis://127.0.0.1:1/0", "CELERY_BROKER_URL": "redis://127.0.0.1:1/0"}


@functools.cache  # one fresh interpreter per import line, shared by the tests that ask about it
def _modules_after(import_line: str) -> frozenset[str]:
    code = f"import sys; {import_line}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=ENV)
    return frozenset(out.stdout.split())


def test_api_imports_neither_torch_nor_tokenizers() -> None:
    mods = _modules_after("import api.main")
    assert "torch" not in mods and "transformers" not in mods and "tokenizers" not in mods


def test_layers_point_down() -> None:
    """shared/ imports no other package of ours; the API and the workers import no infra/ (the
    supervisor, autoscaler and CLI sit on top of everything)."""
    ours = ("api", "workers", "gpu_worker", "infra")
    assert not {m.split(".")[0] for m in _modules_after("import shared.signals, shared.tenants, shared.jobs")} & \
           set(ours)
    for top in ("api.main", "workers.tokenizer.worker", "workers.celery_app"):
        assert not [m for m in _modules_after(f"import {top}") if m.startswith("infra")], top


def test_tokenizer_pool_imports_no_torch() -> None:
    mods = _modules_after("import workers.tokenizer.worker")
    assert "torch" not in mods and "transformers" not in mods
    assert "tokenizers" in mods


def test_api_requests_stay_on_the_event_loop() -> None:
    """FastAPI runs a plain `def` endpoint or dependency in its thread pool: a thread hand-off per
    request, which cut the accepted jobs/s by a fifth. Every route and dependency is `async def`."""
    import inspect

    from fastapi.routing import APIRoute

    from api.main import app

    def sync_calls(dependant) -> list[str]:  # type: ignore[no-untyped-def]
        found = [] if dependant.call is None or inspect.iscoroutinefunction(dependant.call) else [dependant.call]
        for sub in dependant.dependencies:
            found += sync_calls(sub)
        return [getattr(c, "__qualname__", repr(c)) for c in found]

    def api_routes(routes) -> list[APIRoute]:  # type: ignore[no-untyped-def]
        out: list[APIRoute] = []
        for r in routes:
            if isinstance(r, APIRoute):
                out.append(r)
            elif hasattr(r, "original_router"):  # an included router (newer FastAPI keeps them whole)
                out += api_routes(r.original_router.routes)
        return out

    routes = api_routes(app.routes)
    assert len(routes) >= 8
    offenders = {r.path: sync_calls(r.dependant) for r in routes}
    assert {path: calls for path, calls in offenders.items() if calls} == {}
