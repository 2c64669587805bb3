"""What the benchmarks share: every mode's argument parser and model choice, the prompt list, the percentile they
all report, the wait for a quiet machine before a timed run, and the report helpers."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.models import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
__all__ = ["ROOT", "make_tiny_model"]  # re-exported for the benchmarks

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "What does a compiler do?",
    "Suggest a name for a grey cat.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "List four primary school subjects.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What is 17 times 23?",
    "Describe a rainy afternoon in a small town.",
    "What is the difference between a list and a tuple in Python?",
    "Recommend a book for someone who likes science fiction.",
    "How do I boil an egg?",
]


def parser(doc: str, model: bool = True) -> argparse.ArgumentParser:
    """A mode's parser: its docstring as the help, `--quick` and (`model`) `--model`, which `chosen_model` reads."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="seconds: small and short (a tiny random model unless --model)")
    if model:
        p.add_argument("--model", default=None, help="model directory (default: the service's default model)")
    return p


def chosen_model(args: argparse.Namespace) -> str:
    """--model; else, under --quick, a tiny random model; else the service's default."""
    return quick_model(args.model) if args.quick else args.model or default_model()


def quiet() -> None:
    """transformers' warnings, logs and progress bars off: a report holds what was measured."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def messages_for(i: int) -> list[dict[str, str]]:
    """Request i's chat: PROMPTS round-robin."""
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def default_model() -> str:
    """The service's own default (MODEL, else the converted default model in the cache)."""
    from shared.settings import Settings

    return Settings().model_path


def quick_model(model: str | None) -> str:
    """For `--quick`: the model given, else a tiny model built in a temporary directory (removed at exit)."""
    if model:
        return model
    out = Path(tempfile.mkdtemp(prefix="conveyor-tiny-"))
    atexit.register(shutil.rmtree, out, True)
    return make_tiny_model(out, default_model())


def cpu_name() -> str:
    """The CPU's model name and the vector extensions that decide the engine's kernels (every figure names it)."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"
    has = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(has) or 'no AVX2'})"


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class CpuShare:
    """Share of the machine's CPU time used by other processes (or by all, `count_self`) between two
    readings (Linux /proc): the noise indicator of a shared machine. None where /proc is unavailable."""

    def __init__(self, count_self: bool = False) -> None:
        self.count_self = count_self
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[int, int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            with open("/proc/self/stat") as f:
                own = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
        busy = total - fields[3] - fields[4]
        return total, busy, int(own[11]) + int(own[12])  # utime + stime of this process, all threads

    def others(self) -> float | None:
        end = self._read()
        if self.start is None or end is None or end[0] == self.start[0]:
            return None
        d_total, d_busy, d_own = (b - a for a, b in zip(self.start, end))
        return max(0.0, (d_busy - (0 if self.count_self else d_own)) / d_total)


def wait_for_quiet(max_share: float, timeout: float, sample_s: float = 1.0,
                   count_self: bool = False) -> float | None:
    """Before a timed run: wait (`sample_s` samples, at most `timeout` s) until other processes (or all,
    `count_self`) use at most `max_share` of the CPU. Returns the last sample; None, without sampling,
    when `timeout` is 0 or less."""
    if timeout <= 0:
        return None
    deadline = time.monotonic() + timeout
    while True:
        cpu = CpuShare(count_self)
        time.sleep(sample_s)
        share = cpu.others()
        if share is None or share <= max_share or time.monotonic() >= deadline:
            return share


# a neighbour keeping about half a core busy, in 6 ms bursts: what `--hog` runs beside a measurement
HOG = "import time\nwhile True:\n    t = time.time()\n    while time.time() - t < 0.006: pass\n    time.sleep(0.006)\n"


@contextlib.contextmanager
def busy_neighbour(on: bool = True) -> Iterator[bool]:
    """While inside (when `on`), another process keeping about half a core busy; yields `on`."""
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if on else None
    try:
        yield on
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def fmt(x: float, digits: int = 0) -> str:
    return "n/a" if x != x else f"{x:,.{digits}f}"


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def tree_state() -> str:
    """The code a run measured: HEAD, plus a digest of uncommitted changes to tracked files."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD"], cwd=ROOT, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (f" + uncommitted changes (diff sha1 {hashlib.sha1(diff).hexdigest()[:10]})" if diff else "")
