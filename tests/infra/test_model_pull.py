"""`conveyor model pull`'s files: a model directory whose weights were cut short is not taken for complete, and one
found incomplete is replaced by the model made again (before, the rename over it failed, every pull again, and
leaving 517 MB behind each time; and truncated weights passed as present, every worker failing on them). The
download and conversion themselves run in `make model`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from infra.model_pull import REQUIRED, install, is_complete, pull_default, whole_safetensors
from tests.conftest import ROOT


def _model(at: Path) -> Path:
    at.mkdir(parents=True)
    save_file({"w": torch.zeros(64, 64), "b": torch.ones(64)}, str(at / "model.safetensors"))
    for name in REQUIRED[:1] + REQUIRED[2:]:
        (at / name).write_text("{}")
    return at


def test_weights_cut_short_are_not_a_complete_model(tmp_path: Path) -> None:
    model = _model(tmp_path / "m")
    assert whole_safetensors(model / "model.safetensors") and is_complete(model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    assert not whole_safetensors(weights) and not is_complete(model)
    weights.write_bytes(b"\xff" * 8 + data[8:])  # a header length past the file
    assert not is_complete(model)
    weights.write_bytes(data)
    (model / "tokenizer.json").unlink()
    assert not is_complete(model)


def test_an_incomplete_model_directory_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "models" / "M"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # its weights missing
    out = _model(tmp_path / "models" / ".M.pull" / "out")
    (out / "model.safetensors").chmod(0o600)  # as the conversion leaves it
    install(out, target)
    assert is_complete(target) and not out.exists()
    umask = os.umask(0)
    os.umask(umask)
    assert {(p.name, p.stat().st_mode & 0o777) for p in target.iterdir()} == {
        (name, 0o666 & ~umask) for name in REQUIRED}  # readable by a worker run as another user, as the umask allows


def test_a_model_pulled_before_with_private_weights_becomes_readable(tmp_path: Path) -> None:
    """A model an older pull left with 0600 weights: the next pull finds it present and lets others read it (a
    worker run as another user), taking no bit away."""
    target = _model(tmp_path / "models" / "M")
    (target / "model.safetensors").chmod(0o600)
    (target / "config.json").chmod(0o640)
    umask = os.umask(0o022)
    try:
        assert pull_default(target) == target
    finally:
        os.umask(umask)
    assert (target / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (target / "config.json").stat().st_mode & 0o777 == 0o644


def test_a_missing_local_path_is_not_taken_for_a_hub_id(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    out = subprocess.run([sys.executable, "-m", "infra.cli", "model", "pull"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "MODEL": str(missing),
                                                      "CONVEYOR_CACHE": str(tmp_path)})
    assert out.returncode == 1 and f"{missing}: no such directory" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_hub_id_that_cannot_be_fetched_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "infra.cli", "model", "pull"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "MODEL": "someone/no-such-model",
                                                      "CONVEYOR_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1",
                                                      "HF_HOME": str(tmp_path / "hf")})
    assert out.returncode == 1 and "someone/no-such-model: not fetched from the hub" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
