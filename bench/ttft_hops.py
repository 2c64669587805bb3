"""Where a single request's time to first token goes on conveyor's full path, hop by hop.

    .venv/bin/python bench/ttft_hops.py --start              # its own stack, 20 sequential requests
    .venv/bin/python bench/ttft_hops.py --url http://127.0.0.1:8000 --n 50

One request at a time (nothing else in flight), streamed through `/v1/chat/completions` with
--max-tokens tokens (default 4), the next one sent as soon as the previous stream ends (as a closed
loop at concurrency 1 does); afterwards the job records' timestamps (`GET /v1/jobs/{id}`) split each
client's TTFT into:
  accept   client sends -> API has written the job (`created_at`)
  queue    created -> the inference worker starts it (`started_at`): jobs stream, tokenizer pool,
           tokenized stream, inference reader
  engine   started -> the output lane has the first token (`first_token_at`): engine inbox, prefill step,
           hand-off to the lane
  deliver  first_token_at -> the client reads the first content chunk: MULTI/EXEC, PUBLISH, the API's
           relay, SSE, the client's parser
All processes share this machine's clock. Medians and p90 over --n requests (after 3 untimed).
`--gap S` idles S seconds between requests instead.

It also times `GET /healthz` (no Redis, no engine) back to back and after 10, 50 and 200 ms idle:
what one wake-up of a sleeping process costs on this host. On a VM whose idle vCPUs halt, that
cost grows with idle time and is paid at every hop of the path above.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import DEFAULT_MODEL, messages_for, start_conveyor  # noqa: E402
from workload import percentile  # noqa: E402

HOPS = ("accept", "queue", "engine", "deliver", "ttft")


def one(client: httpx.Client, url: str, i: int, max_tokens: int) -> tuple[str, float, float]:
    """(job id, sent, first content chunk read), wall-clock seconds."""
    body = {"messages": messages_for(i), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    sent = time.time()
    first = None
    cid = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            cid = chunk.get("id", cid)
            delta = (chunk.get("choices") or [{}])[0].get("delta", {})
            if first is None and delta.get("content"):
                first = time.time()
    return f"job_{cid.split('-', 1)[1]}", sent, first


def hops(client: httpx.Client, url: str, job_id: str, sent: float, first: float) -> dict[str, float]:
    job = client.get(f"{url}/v1/jobs/{job_id}").json()
    created, started, tok = job["created_at"], job["started_at"], job["first_token_at"]
    return {"accept": created - sent, "queue": started - created, "engine": tok - started,
            "deliver": first - tok, "ttft": first - sent}


def wake_cost(client: httpx.Client, url: str, n: int = 20) -> dict[float, float]:
    """Median `GET /healthz` round trip (ms) after each idle gap (seconds)."""
    out = {}
    for gap in (0.0, 0.01, 0.05, 0.2):
        ts = []
        for _ in range(n):
            time.sleep(gap)
            t = time.perf_counter()
            client.get(f"{url}/healthz").raise_for_status()
            ts.append(time.perf_counter() - t)
        out[gap] = statistics.median(ts) * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url")
    where.add_argument("--start", action="store_true", help="start `conveyor up` for the run")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--model", default=os.environ.get("MODEL") or DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per request (EOS ignored)")
    p.add_argument("--gap", type=float, default=0.0, help="idle seconds between requests (default: none)")
    args = p.parse_args()
    server = start_conveyor(args, Path(tempfile.mkdtemp(prefix="conveyor-ttft-"))) if args.start else None
    url = server.url if server else args.url.rstrip("/")
    try:
        with httpx.Client(timeout=120) as client:
            for i in range(3):
                one(client, url, i, args.max_tokens)
            sent = []
            for i in range(args.n):
                sent.append(one(client, url, i, args.max_tokens))
                time.sleep(args.gap)
            rows = [hops(client, url, *r) for r in sent]
            wake = wake_cost(client, url)
    finally:
        if server:
            server.stop()
    spacing = f"{args.gap * 1e3:.0f} ms apart" if args.gap else "back to back"
    print(f"\n{args.n} requests {spacing}, {args.max_tokens} tokens each, ms\n")
    print("| hop | p50 | p90 | max |\n|---|---|---|---|")
    for h in HOPS:
        xs = [r[h] * 1e3 for r in rows]
        print(f"| {h} | {statistics.median(xs):.1f} | {percentile(xs, 90):.1f} | {max(xs):.1f} |")
    print("\nGET /healthz round trip, p50 ms, after idling: "
          + ", ".join(f"{g * 1e3:.0f} ms -> {ms:.2f}" for g, ms in wake.items()))


if __name__ == "__main__":
    main()
