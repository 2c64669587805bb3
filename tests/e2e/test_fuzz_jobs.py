"""Hostile jobs against the whole stack (the tiny model): a few hundred requests that the schema
accepts, pushed to its edges (tiny and huge numbers, every kind of Unicode, empty and long stop
strings, token ids at the vocabulary's edge, cancels racing the start), sent 8 at a time. Every one is
accepted or refused with a 4xx; afterwards every accepted job has ended (succeeded, cancelled, or failed with
a message), no worker process was restarted, and a plain greedy job still answers as it did before."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.limits import INT32_MAX, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SEED_MAX, SEED_MIN
from tests.helpers import chat, submit, wait

pytestmark = pytest.mark.slow

VOCAB = 49152
EXAMPLES = 300

# any code point but lone surrogates (JSON cannot carry them as text) and NUL (refused at the door)
text_chars = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
texts = st.one_of(st.text(text_chars, min_size=1, max_size=200),
                  st.sampled_from(["", " ", "\n", "🙂" * 40, "e\u0301" * 30, "مرحبا بالعالم", "\ufeff", "<|im_end|>"]))
stop_strings = st.one_of(st.text(text_chars, min_size=1, max_size=8),
                         st.text(text_chars, min_size=MAX_STOP_CHARS, max_size=MAX_STOP_CHARS),
                         st.sampled_from([" ", "e", "\n", ".", "�"]))
token_ids = st.one_of(st.sampled_from([0, 1, 2, VOCAB - 1]), st.integers(0, VOCAB - 1))


def _edge_floats(lo: float, hi: float, edges: list[float]) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(edges), st.floats(lo, hi, allow_nan=False, allow_infinity=False))


jobs = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 6)},
    optional={
        "temperature": _edge_floats(0.0, 2.0, [0.0, 1e-40, 5e-324, 0.0099, 0.01, 2.0]),
        "top_p": _edge_floats(5e-324, 1.0, [5e-324, 1e-300, 0.001, 1.0]).filter(lambda p: p > 0),
        "top_k": st.one_of(st.sampled_from([0, 1, VOCAB - 1, VOCAB]), st.integers(0, VOCAB)),
        "seed": st.one_of(st.sampled_from([SEED_MIN, -1, 0, 2**63 - 1, SEED_MAX]), st.integers(SEED_MIN, SEED_MAX)),
        "stop": st.one_of(stop_strings, st.lists(stop_strings, max_size=MAX_STOP_STRINGS)),
        "stop_token_ids": st.lists(token_ids, max_size=MAX_STOP_TOKEN_IDS),
        "ignore_eos": st.booleans(),
    },
).flatmap(lambda params: st.one_of(
    st.fixed_dictionaries({"prompt": texts}).map(lambda x: {**params, **x}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": texts}), min_size=1, max_size=4)},
    ).map(lambda x: {**params, **x}),
))
actions = st.sampled_from(["none", "none", "none", "cancel_now", "cancel_later"])


def _supervisor(stack: Any) -> dict[str, Any]:
    state = json.loads((Path(stack.env["CONVEYOR_CACHE"]) / "supervisor.json").read_text())
    return {name: (sorted(p["pids"]), p["restarts"]) for name, p in state["pools"].items()}


def test_hostile_jobs_fail_only_themselves(tiny_stack: Any) -> None:
    stack = tiny_stack
    before = _supervisor(stack)
    accepted: list[str] = []
    later: list[str] = []
    statuses: dict[int, int] = {}
    assert INT32_MAX > VOCAB

    plain = {"messages": chat("What is the capital of France?"), "temperature": 0, "max_tokens": 20}
    examples: list[tuple[dict[str, Any], str]] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=jobs, action=actions)
    def hostile(body: dict[str, Any], action: str) -> None:
        examples.append((body, action))

    hostile()  # drawn first, then sent 8 at a time: the stack takes them concurrently, as from many clients

    async def send(client: httpx.AsyncClient, body: dict[str, Any], action: str, slots: asyncio.Semaphore) -> None:
        async with slots:
            r = await client.post("/v1/jobs", json=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.text)
            if r.status_code != 202:
                assert r.status_code in (413, 422) and r.json()["error"]["message"], (body, r.text)
                return
            job_id = r.json()["id"]
            accepted.append(job_id)
            if action == "cancel_now":
                assert (await client.post(f"/v1/jobs/{job_id}/cancel")).status_code in (200, 409)
            elif action == "cancel_later":
                later.append(job_id)
            if len(later) >= 5:  # cancel a few that may be running by now
                batch = later[:]
                later.clear()
                for j in batch:
                    assert (await client.post(f"/v1/jobs/{j}/cancel")).status_code in (200, 409)

    async def send_all() -> None:
        slots = asyncio.Semaphore(8)
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            await asyncio.gather(*(send(client, body, action, slots) for body, action in examples))

    with httpx.Client(base_url=stack.url, timeout=60) as client:
        reference = wait(client, submit(client, **plain)["id"])
        asyncio.run(send_all())
        print(f"hostile jobs: {sum(statuses.values())} requests, statuses {statuses}, {len(accepted)} accepted")
        assert len(examples) == EXAMPLES and len(accepted) > EXAMPLES // 2

        ends: dict[str, int] = {}
        reasons: dict[str, int] = {}
        for job_id in accepted:
            job = wait(client, job_id, timeout=300)
            ends[job["status"]] = ends.get(job["status"], 0) + 1
            if job["status"] == "failed":
                assert job["error"], job
                reasons[job["error"][:50]] = reasons.get(job["error"][:50], 0) + 1
        print(f"hostile jobs ended: {ends}; failures: {reasons}")

        after = _supervisor(stack)
        assert after == before, (before, after)  # same pids, no restart
        done = wait(client, submit(client, **plain)["id"])
        assert done["status"] == "succeeded" and done["text"] == reference["text"], (reference, done)
    r = httpx.get(stack.url + "/readyz")
    assert r.status_code == 200
