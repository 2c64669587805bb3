"""The import graph: packages point down (infra -> api, workers, gpu_worker -> shared), and no two
modules of ours import each other, directly or round a loop (type-checking imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "api", "workers", "gpu_worker", "infra")
# what each package may import, besides itself
ALLOWED = {"shared": set(), "api": {"shared"}, "workers": {"shared"}, "gpu_worker": {"shared"},
           "infra": {"shared", "api", "workers", "gpu_worker"}}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    mods = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name in mods and name != mod:
                    graph[mod].add(name)
    return graph


def test_packages_point_down() -> None:
    up = sorted((m, d) for m, deps in import_graph().items() for d in deps
                if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in ALLOWED[m.split(".")[0]])
    assert not up


def test_no_import_cycles() -> None:
    graph = import_graph()
    for pkg_init in [m for m in graph if m in PACKAGES]:  # a package's __init__ re-exports its modules
        graph[pkg_init] = set()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles
