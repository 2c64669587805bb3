"""Where a single request's time to first token goes on conveyor's full path, hop by hop.

    .venv/bin/python bench/ttft_hops.py --start              # its own stack, 20 sequential requests
    .venv/bin/python bench/ttft_hops.py --url http://127.0.0.1:8000 --n 50

One request at a time (nothing else in flight), streamed through `/v1/chat/completions` with 4 tokens,
then the job record's timestamps (`GET /v1/jobs/{id}`) split the client's TTFT into:
  accept   client sends -> API has written the job (`created_at`)
  queue    created -> the inference worker starts it (`started_at`): jobs stream, tokenizer pool,
           tokenized stream, inference reader
  engine   started -> the output lane has the first token (`first_token_at`): engine inbox, prefill step,
           hand-off to the lane
  deliver  first_token_at -> the client reads the first content chunk: MULTI/EXEC, PUBLISH, the API's
           relay, SSE, the client's parser
All processes share this machine's clock. Medians and p90 over --n requests (after 3 untimed).
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


def one(client: httpx.Client, url: str, i: int) -> dict[str, float]:
    body = {"messages": messages_for(i), "max_tokens": 4, "temperature": 0, "stream": True}
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
    job = client.get(f"{url}/v1/jobs/job_{cid.split('-', 1)[1]}").json()
    created, started, tok = job["created_at"], job["started_at"], job["first_token_at"]
    return {"accept": created - sent, "queue": started - created, "engine": tok - started,
            "deliver": first - tok, "ttft": first - sent}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url")
    where.add_argument("--start", action="store_true", help="start `conveyor up` for the run")
    p.add_argument("--n", type=int, default=20)
    p.add_argument("--model", default=os.environ.get("MODEL") or DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float16"])
    args = p.parse_args()
    server = start_conveyor(args, Path(tempfile.mkdtemp(prefix="conveyor-ttft-"))) if args.start else None
    url = server.url if server else args.url.rstrip("/")
    try:
        with httpx.Client(timeout=120) as client:
            for i in range(3):
                one(client, url, i)
            rows = [one(client, url, i) for i in range(args.n)]
    finally:
        if server:
            server.stop()
    print(f"\n{args.n} sequential requests, 4 tokens each, ms\n")
    print("| hop | p50 | p90 | max |\n|---|---|---|---|")
    for h in HOPS:
        xs = [r[h] * 1e3 for r in rows]
        print(f"| {h} | {statistics.median(xs):.1f} | {percentile(xs, 90):.1f} | {max(xs):.1f} |")


if __name__ == "__main__":
    main()
