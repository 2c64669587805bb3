"""Types: mypy, run as pyproject.toml's [tool.mypy] configures it (strict, on api/, shared/, gpu_worker/ and
workers/), reports no error. Its cache (.mypy_cache/) keeps a run after the first to the
files that changed; the first, on a fresh clone, takes ~15 s (`slow`: handed out first, and `make lint` runs mypy
too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_reports_no_error() -> None:
    run = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout + run.stderr
