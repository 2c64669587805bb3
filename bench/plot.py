"""Charts for the benchmarks: output tokens/s, TTFT and ITL against concurrency, every contender on
one figure, written as a PNG beside the run's JSON (matplotlib, from the `bench` extra).

    .venv/bin/python bench/plot.py serve.json          # redraw serve.png from a saved run
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PANELS = (("tok_s", "output tokens/s"), ("ttft_p50", "TTFT p50 (ms)"), ("itl_p50", "ITL p50 (ms)"))


def plot_rows(rows: list[dict[str, Any]], out: Path, title: str, x_key: str = "level",
              x_label: str = "concurrent streams") -> Path | None:
    """One panel per metric, one line per contender (`target`), x = `x_key`. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[plot] matplotlib is not installed (pip install -e '.[bench]'); no chart", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, len(PANELS), figsize=(12, 3.6), dpi=100)
    targets = list(dict.fromkeys(r["target"] for r in rows))
    numeric = all(str(r[x_key]).isdigit() for r in rows)
    for ax, (key, label) in zip(axes, PANELS):
        for target in targets:
            pts = [(r[x_key], r[key]) for r in rows if r["target"] == target and r.get(key) == r.get(key)]
            if numeric:
                pts = sorted((int(x), y) for x, y in pts)
            xs, ys = [str(x) if not numeric else x for x, _ in pts], [y for _, y in pts]
            ax.plot(xs, ys, marker="o", label=target)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(x_label, fontsize=9)
        if numeric:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({int(r[x_key]) for r in rows}), labels=sorted({str(int(r[x_key])) for r in rows},
                                                                                 key=int))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    print(f"[plot] wrote {out}", file=sys.stderr)
    return out


def main(argv: list[str]) -> int:
    for name in argv:
        path = Path(name)
        data = json.loads(path.read_text())
        rows = data.get("results") or []
        plot_rows(rows, path.with_suffix(".png"), data.get("title", path.stem))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
