"""Schemathesis against the running stack's own OpenAPI schema: every operation, positive and
negative inputs, and stateful sequences that follow the schema's links (submit, then poll, stream
and cancel the job it made). No answer may be a 5xx, and every answer must match its declared
schema. The stack runs a tiny model so the generated jobs end quickly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, Stack, start_stack, stop_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory: pytest.TempPathFactory, redis_server, tiny_model_dir: str) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    url = redis_server.url.rsplit("/", 1)[0] + "/11"
    s = start_stack(tmp_path_factory.mktemp("fuzz-stack"), url, tiny_model_dir,
                    extra={"MAX_TOKENS_CAP": "16", "DEFAULT_MAX_TOKENS": "8", "MAX_MODEL_LEN": "2048"})
    yield s
    stop_stack(s)


def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(tiny_stack: Stack, tmp_path: Path) -> None:
    st_cmd = [str(Path(sys.executable).parent / "st")]  # installed beside this interpreter
    seed = os.environ.get("FUZZ_SEED", "1")
    # schemathesis's dependency analysis reads `stop_token_ids` as a reference to a "StopToken" resource
    # nothing creates, and so never starts a sequence from POST /v1/jobs; follow the schema's links instead
    config = tmp_path / "schemathesis.toml"
    config.write_text('[phases.stateful.inference]\nalgorithms = ["location-headers"]\n')
    proc = subprocess.run(
        [*st_cmd, "--config-file", str(config), "run", f"{tiny_stack.url}/openapi.json",
         "--checks", "not_a_server_error,response_schema_conformance",
         "--phases", "examples,coverage,fuzzing,stateful", "--max-examples", os.environ.get("FUZZ_EXAMPLES", "10"),
         "--seed", seed, "--workers", "1", "--request-timeout", "60", "--generation-database", "none",
         "--no-color", "--report", "junit", "--report-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    tried = re.search(r"(\d+) generated", out)
    print(f"schemathesis (seed {seed}): {tried.group(0) if tried else '?'}; {out[-1500:]}")
    print("\n".join(line for line in out.splitlines() if " (in " in line))
    links = re.search(r"API Links:\s+(\d+) covered / (\d+) selected", out)
    assert links and int(links.group(1)) == int(links.group(2)) >= 3, out[-3000:]  # submit -> poll, events, cancel
