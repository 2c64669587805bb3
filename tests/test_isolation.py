"""The isolation zones hold: the API never imports torch or a tokenizer; the tokenizer pool no torch."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def _modules_after(import_line: str) -> set[str]:
    code = f"import sys; {import_line}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "REDIS_URL": "redis://127.0.0.1:1/0"})
    return set(out.stdout.split())


def test_api_imports_neither_torch_nor_tokenizers() -> None:
    mods = _modules_after("import api.main")
    assert "torch" not in mods and "transformers" not in mods and "tokenizers" not in mods


def test_tokenizer_pool_imports_no_torch() -> None:
    mods = _modules_after("import workers.tokenizer.worker")
    assert "torch" not in mods and "transformers" not in mods
    assert "tokenizers" in mods
