"""The image builds its entrypoint: the Dockerfile's COPY and `pip install` lines are replayed into a wheel,
which declares the ENTRYPOINT's console script and holds every module, data file and dependency the processes
load. Its torch is the Makefile's."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import email
import email.message
import importlib
import importlib.metadata
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Mapping
from fnmatch import fnmatch
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from tests.infra.deploy_files import (
    CONVEYOR,
    DOCKER_ARGS,
    DOCKERFILE,
    ROOT,
    built_services,
    compose_argv,
    healthcheck_argv,
    instructions,
    interpolate,
    k8s_argv,
)
from tests.infra.deploy_processes import app_containers, celery_command, celery_parts

BASE_IMAGE_EXECUTABLES = {"python", "python3", "pip", "sh"}  # what a python:* base image has on its PATH


@dataclasses.dataclass
class Image:
    """What the Dockerfile's `pip install` of the project puts in the image: the wheel of what it copies."""

    files: dict[str, bytes]
    extras: frozenset[str]

    def text(self, name: str) -> str:
        return self.files[name].decode()

    def dist_info(self, name: str) -> str:
        [path] = [f for f in self.files if re.fullmatch(rf"[^/]+\.dist-info/{name}", f)]
        return self.text(path)

    @property
    def metadata(self) -> email.message.Message:
        return email.message_from_string(self.dist_info("METADATA"))

    @property
    def console_scripts(self) -> dict[str, str]:
        section, scripts = "", {}
        for line in self.dist_info("entry_points.txt").splitlines():
            if line.startswith("["):
                section = line.strip().strip("[]")
            elif section == "console_scripts" and "=" in line:
                name, _, target = line.partition("=")
                scripts[name.strip()] = target.strip()
        return scripts


def dockerignored(rel: str) -> bool:
    ignore = ROOT / ".dockerignore"
    if not ignore.exists():
        return False
    patterns = [p.strip().strip("/") for p in ignore.read_text().splitlines() if p.strip() and p[0] not in "#!"]
    return any(fnmatch(rel, p) or fnmatch(rel, f"{p}/*") for p in patterns)


def replay_copies(into: Path) -> tuple[Path, frozenset[str]]:
    """Replay the Dockerfile's WORKDIR and COPY lines into `into` (the image's /) up to its `pip install`
    of the project; return the directory pip installs and the extras it asks for."""
    workdir = "/"
    for ins in DOCKERFILE:
        if ins.keyword == "WORKDIR":
            workdir = posixpath.join(workdir, ins.value)
        elif ins.keyword in ("COPY", "ADD"):
            words = json.loads(ins.value) if ins.value.startswith("[") else shlex.split(ins.value)
            assert not any(w.startswith("--from") for w in words), "multi-stage builds are not replayed"
            *sources, dest = [w for w in words if not w.startswith("--")]
            target = into / posixpath.join(workdir, dest).lstrip("/")
            for pattern in sources:
                matches = sorted(p for p in ROOT.glob(pattern) if not dockerignored(p.relative_to(ROOT).as_posix()))
                assert matches, f"{ins.keyword} {pattern}: not in the build context"
                for src in matches:
                    if src.is_dir():
                        shutil.copytree(src, target, dirs_exist_ok=True, ignore=lambda d, found: [
                            f for f in found if f == "__pycache__"
                            or dockerignored((Path(d) / f).relative_to(ROOT).as_posix())])
                    else:
                        to = target / src.name if dest.endswith("/") or len(matches) > 1 else target
                        to.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(src, to)
        elif ins.keyword == "RUN":
            for found in re.finditer(r"\bpip install\b([^;&|]*)", ins.value):
                local = [w for w in shlex.split(found.group(1)) if w.startswith((".", "/"))]
                if local:
                    path, _, extras = local[0].partition("[")
                    project = into / posixpath.join(workdir, path).lstrip("/")
                    return project, frozenset(e.strip() for e in extras.rstrip("]").split(",") if e.strip())
    raise AssertionError("the Dockerfile never installs the project")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    root = tmp_path_factory.mktemp("image")
    project, extras = replay_copies(root / "fs")
    out = root / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "-w", str(out), str(project)],
        capture_output=True, text=True, timeout=600, env=os.environ | {"PIP_NO_INPUT": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
    [wheel] = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        return Image({n: z.read(n) for n in z.namelist()}, extras)


FIRST_PARTY = frozenset({p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
                        | {p.stem for p in ROOT.glob("*.py")})
MODULE_REFERENCE = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?::[A-Za-z_]\w*)?")  # "api.main:app"


def source_module(name: str) -> bool:
    base = ROOT / name.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def module_file(name: str, files: Mapping[str, bytes]) -> str | None:
    base = name.replace(".", "/")
    return next((f for f in (f"{base}.py", f"{base}/__init__.py") if f in files), None)


def run_time_imports(module: str, source: str, is_package: bool) -> tuple[set[str], set[str]]:
    """(first-party modules, third-party top-level names) a module imports when it runs: imports under
    `if TYPE_CHECKING:` and in `try: ... except ImportError:` are left out, and strings naming a module
    of ours ("api.main:app", for uvicorn) count as imports."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        body: list[ast.stmt] = []
        if isinstance(node, ast.Try) and any(
                h.type is not None and {"ImportError", "ModuleNotFoundError"} & {
                    n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)} for h in node.handlers):
            body = node.body
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body = node.body
        skipped |= {id(n) for stmt in body for n in ast.walk(stmt)}
    package = module if is_package else module.rpartition(".")[0]
    ours: set[str] = set()
    theirs: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        required: list[str] = []
        maybe: list[str] = []
        if isinstance(node, ast.Import):
            required = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([node.module] if node.module else [])])
            required, maybe = [base], [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if found := MODULE_REFERENCE.fullmatch(node.value):
                maybe = [found.group(1)]
        for name in required + [m for m in maybe if source_module(m)]:
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                ours.add(name)
            elif name in required and top not in sys.stdlib_module_names and top != "__future__":
                theirs.add(top)
    return ours, theirs


def entry_modules(image: Image) -> set[str]:
    """The modules the processes start from: the console script's, and each `celery -A` app."""
    commands = [k8s_argv(c) for _, c, _ in app_containers()] + [compose_argv(s) for s in built_services().values()]
    modules = {image.console_scripts[CONVEYOR].split(":")[0]}
    modules |= {celery_parts(celery)[0] for argv in commands if (celery := celery_command(argv))}
    return modules


def load_closure(image: Image) -> tuple[set[str], set[str], set[str]]:
    """(modules of ours the processes load, those the image lacks, third-party names they import)."""
    todo, seen, missing, theirs = sorted(entry_modules(image)), set(), set(), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        path = module_file(name, image.files)
        if path is None:
            missing.add(name)
            continue
        ours, imported = run_time_imports(name, image.text(path), path.endswith("__init__.py"))
        todo += sorted(ours)
        theirs |= imported
    return seen, missing, theirs


def installed_closure(roots: Iterable[Requirement], extras: frozenset[str]) -> set[str]:
    """The distributions pip installs for these requirements (as this environment resolved them)."""
    todo = [(r.name, frozenset(r.extras)) for r in roots
            if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in {"", *extras})]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        key = (canonicalize_name(name), wanted)
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in {"", *wanted}):
                todo.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen}


def image_distributions(image: Image) -> set[str]:
    """The project's requirements with the Dockerfile's extras, and the torch it installs first."""
    roots = [Requirement(r) for r in image.metadata.get_all("Requires-Dist") or []]
    roots.append(Requirement(DOCKER_ARGS["TORCH_SPEC"]))
    return installed_closure(roots, image.extras)


def test_the_image_builds_its_entrypoint(image: Image) -> None:
    """The wheel declares the ENTRYPOINT's console script, pointing at a function that takes no arguments;
    the extras installed exist and the base image's Python satisfies requires-python."""
    scripts = image.console_scripts
    assert CONVEYOR in scripts, f"the wheel declares {sorted(scripts)}, the ENTRYPOINT runs {CONVEYOR}"
    module, _, function = scripts[CONVEYOR].partition(":")
    path = module_file(module, image.files)
    assert path, f"{scripts[CONVEYOR]}: no {module} in the image"
    functions = {n.name: n for n in ast.parse(image.text(path)).body if isinstance(n, ast.FunctionDef)}
    assert function in functions, f"{scripts[CONVEYOR]}: no function {function} in {path}"
    arguments = functions[function].args
    assert len(arguments.args) == len(arguments.defaults), "a console script calls it without arguments"
    assert image.extras <= set(image.metadata.get_all("Provides-Extra") or []), "pip install asks for no such extra"
    [base] = instructions("FROM")
    python = re.match(r"python:(\d+\.\d+)", base)
    assert python, f"{base}: not a python image"
    assert SpecifierSet(image.metadata["Requires-Python"] or "").contains(python.group(1))


def test_the_image_holds_every_module_and_file_the_processes_load(image: Image) -> None:
    """Every module the entry points import at run time, the dashboard's files and the Lua scripts."""
    loaded, missing, _ = load_closure(image)
    assert {"api.main", "workers.celery_app", "gpu_worker.worker"} <= loaded  # reached through the entry points
    assert not missing, f"imported at run time, absent from the image: {sorted(missing)}"
    # the dashboard's page and everything it links (GET /dashboard, /dashboard/static/...)
    page = image.text("api/static/dashboard.html")
    assets = re.findall(r"(?:src|href)=\"/dashboard/static/([^\"]+)\"", page)
    assert assets
    for asset in assets:
        assert f"api/static/{asset}" in image.files, asset
    for path in (ROOT / "api" / "static").rglob("*"):
        if path.is_file():
            assert path.relative_to(ROOT).as_posix() in image.files, path
    # the Redis protocol's Lua scripts, each loaded by name when shared.scripts is imported
    scripts = re.findall(r"\bScript\(\"(\w+)\"\)", image.text("shared/scripts/__init__.py"))
    assert scripts
    for name in scripts:
        assert f"shared/scripts/{name}.lua" in image.files, name
    for path in (ROOT / "shared" / "scripts").glob("*.lua"):
        assert path.relative_to(ROOT).as_posix() in image.files, path
    # the CPU kernels' sources, compiled by the inference worker on first use
    for path in (ROOT / "gpu_worker" / "engine" / "csrc").glob("*.cpp"):
        assert path.relative_to(ROOT).as_posix() in image.files, path


def test_the_image_installs_every_distribution_the_processes_import(image: Image) -> None:
    """Every third-party import is installed by the project's requirements (with the Dockerfile's extras)
    or the torch installed first, and every command the files run is an executable of the image."""
    _, _, imported = load_closure(image)
    installed = image_distributions(image)
    providers = importlib.metadata.packages_distributions()
    absent = sorted(top for top in imported
                    if not any(canonicalize_name(d) in installed for d in providers.get(top, [])))
    assert not absent, f"imported at run time, installed by nothing in the image: {absent}"
    # and every command the files run is on the image's PATH
    executables = set(image.console_scripts) | BASE_IMAGE_EXECUTABLES
    for dist in installed:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            executables |= {e.name for e in importlib.metadata.distribution(dist).entry_points
                            if e.group == "console_scripts"}
    commands = [k8s_argv(c) for _, c, _ in app_containers()] + [compose_argv(s) for s in built_services().values()]
    commands += [healthcheck_argv(s["healthcheck"]["test"]) for s in built_services().values() if "healthcheck" in s]
    commands += [c[kind]["exec"]["command"] for _, c, _ in app_containers()
                 for kind in ("startupProbe", "livenessProbe", "readinessProbe") if "exec" in c.get(kind, {})]
    for argv in commands:
        assert Path(argv[0]).name in executables, f"`{shlex.join(argv)}`: no {argv[0]} in the image"


def makefile_default(name: str) -> str:
    found = re.search(rf"^{name}\s*[?:]?=\s*(.*?)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"the Makefile sets no {name}"
    return found.group(1)


def test_the_image_and_the_makefile_install_the_same_torch() -> None:
    spec = DOCKER_ARGS["TORCH_SPEC"]
    assert Requirement(spec).name == "torch"
    assert spec == makefile_default("TORCH_SPEC"), "`make` and `docker build` install different torch"
    for name, service in built_services().items():
        args = service["build"].get("args", {})
        if "TORCH_SPEC" in args:
            assert interpolate(str(args["TORCH_SPEC"]), {}) == spec, name
        if "TORCH_INDEX" in args:
            assert interpolate(str(args["TORCH_INDEX"]), {}) == DOCKER_ARGS["TORCH_INDEX"], name
