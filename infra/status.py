"""`conveyor status`: the stack at a glance in a terminal: each pool's live workers, queue lag,
pending and running jobs, KV-cache use, the supervisor's pids and restarts, the tenants' waiting jobs
and share of service, from the same
signals as /metrics and /scaling (Redis, plus `<cache>/supervisor.json` when the stack is local)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from shared import names, pool_fault
from shared.fair_queue import read_tenants, tenant_rows
from shared.redis_client import RETRYABLE, sync_client
from shared.signals import read_snapshot

READ_S = 3.0  # a reply waited for: a Redis that stopped answering is said within seconds


def snapshot(client: redis.Redis, raw: redis.Redis, max_num_seqs: int, cache_dir: Path,
             models: Sequence[str] = ("",)) -> dict[str, Any]:
    """What `render` shows: each pool's row (a model's pool each), the supervisor's state, the latest decisions,
    the dead letters."""
    snap = read_snapshot(raw, names.pools(models), names.stream_groups(models))
    pools: dict[str, Any] = {}
    for pool, s in snap.pool_signals(max_num_seqs, models).items():
        workers = snap.workers[pool]
        pools[pool] = {"workers": len(workers), "lag": s.lag, "pending": s.pending,
                       "running": sum(w.running for w in workers), "waiting": sum(w.waiting for w in workers),
                       "kv": max((w.kv_cache_usage for w in workers), default=0.0),
                       "not_invariant": sum(not w.batch_invariant for w in workers)}
    supervisor = _supervisor_state(cache_dir / "supervisor.json")
    decisions = [fields for _id, fields in client.xrevrange(names.SCALING_DECISIONS_STREAM, count=5)]
    return {"pools": pools, "faults": pool_fault.faults(client, list(pools)), "supervisor": supervisor,
            "decisions": decisions, "dead_letters": dead_letters(client),
            "tenants": tenant_rows(read_tenants(raw, models=models))}



def _supervisor_state(path: Path) -> dict[str, Any] | None:
    """The local supervisor's state, if its supervisor lives: one killed (SIGKILL) leaves its file behind, whose pids
    are no stack's any more."""
    try:
        state = json.loads(path.read_text())
        os.kill(int(state["pid"]), 0)
    except PermissionError:  # alive, another user's
        pass
    except (OSError, ValueError, KeyError, TypeError):  # gone (ProcessLookupError), none, or not the supervisor's
        return None
    return state if isinstance(state, dict) else None


def dead_letters(client: redis.Redis) -> int:
    """Entries in the dead-letter streams, summed over the partitions."""
    pipe = client.pipeline(transaction=False)
    for stream in names.streams(names.DEAD):
        pipe.xlen(stream)
    return sum(int(n) for n in pipe.execute())


def render(snap: dict[str, Any]) -> Group:
    table = Table(title="conveyor", title_justify="left")
    for col in ("pool", "workers", "lag", "pending", "running", "waiting", "KV cache", "pids", "restarts"):
        table.add_column(col, justify="left" if col in ("pool", "pids") else "right")
    sup = (snap["supervisor"] or {}).get("pools", {})
    for pool, p in snap["pools"].items():
        local = sup.get(pool, {})
        table.add_row(pool, str(p["workers"]), str(p["lag"]), str(p["pending"]), str(p["running"]),
                      str(p["waiting"]), f"{p['kv']:.0%}" if pool != names.TOKENIZER_POOL else "",
                      " ".join(map(str, local.get("pids", []))), str(local.get("restarts", "")))
    for pool, local in sup.items():
        if pool not in snap["pools"]:
            table.add_row(pool, str(len(local.get("pids", []))), "", "", "", "", "",
                          " ".join(map(str, local.get("pids", []))), str(local.get("restarts", "")))
    parts: list[Any] = [table, f"dead letters: {snap['dead_letters']}"]
    for pool, p in snap["pools"].items():
        if p.get("not_invariant"):
            parts.append(Text(f"{pool}: {p['not_invariant']} of {p['workers']} workers not batch-invariant (CUDA, "
                              "CPU_KERNELS=false, or a CPU kernel that did not build): a seed does not hold its text "
                              "there", style="yellow"))
    for pool, fault in snap.get("faults", {}).items():  # why its latest worker failed to start
        ago = max(0.0, time.time() - fault.at)
        parts.append(Text(f"{pool}: failing to start ({fault.failures} failures, the latest {ago:.0f} s ago): "
                          f"{fault.reason}", style="red"))
    if snap["tenants"]:
        tenants = Table(title="tenants (fair queue)", title_justify="left")
        for col in ("tenant", "waiting", "oldest wait", "served tokens", "share"):
            tenants.add_column(col, justify="left" if col == "tenant" else "right")
        for t in snap["tenants"]:
            tenants.add_row(t["tenant"], str(t["waiting"]), f"{t['oldest_wait_s']:.1f} s", str(t["served_tokens"]),
                            f"{t['share']:.0%}")
        parts.append(tenants)
    if snap["decisions"]:
        decisions = Table(title="latest scaling decisions", title_justify="left")
        for col in ("time", "pool", "from", "to", "reason"):
            decisions.add_column(col)
        for d in snap["decisions"]:
            at = time.strftime("%H:%M:%S", time.localtime(float(d.get("at", 0))))
            decisions.add_row(at, d.get("pool", ""), d.get("from", ""), d.get("to", ""), d.get("reason", ""))
        parts.append(decisions)
    return Group(*parts)


def run(url: str, max_num_seqs: int, cache_dir: Path, watch: bool, models: Sequence[str] = ("",),
        every_s: float = 1.0) -> int:
    """Print the stack's state once (1 and one line when Redis does not answer), or keep it on screen (`watch`:
    a Redis that stops answering is said in place of the tables until it answers again)."""
    console = Console()
    if not console.is_terminal:  # piped: no terminal width to fit, so do not squeeze the columns
        console = Console(width=160)
    clients: list[redis.Redis] = []  # made again after a failure (a cluster down at the first try looked single)

    def view() -> Any:
        try:
            if not clients:
                client = sync_client(url, retries=1, timeout=READ_S, wait_s=READ_S)
                client.ping()  # (answered: the second client knows the kind at once)
                clients[:] = [client, sync_client(url, decode=False, retries=1, timeout=READ_S)]
            return render(snapshot(clients[0], clients[1], max_num_seqs, cache_dir, models))
        except (redis.RedisError, *RETRYABLE) as exc:
            clients.clear()
            return Text(f"Redis does not answer: {exc}", style="red")

    first = view()
    if not watch:
        console.print(first)
        return 1 if isinstance(first, Text) else 0
    with Live(first, console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(every_s)
                live.update(view())
        except KeyboardInterrupt:
            pass
    return 0
