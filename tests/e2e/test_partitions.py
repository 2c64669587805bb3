"""Network partitions, on namespaces (harness/netns.py; the scenarios are harness/partitions.py's): a process
cut off from Redis by a dropped link, not killed, so its connections hang rather than reset, and then healed.

- The API alone in its namespace: while cut, submits and polls answer 503 with Retry-After within the API's own
  timeouts (never a 500, never a hang); after the heal every job accepted before the cut ends succeeded, new
  submits are accepted and streamed live, and a 503'd submit retried with its Idempotency-Key is one job.
- An inference worker cut off while it runs jobs, longer than CLAIM_IDLE_MS: another worker claims and finishes
  each exactly once (succeeded, the clean run's text, event seqs 1..n), and once the cut-off worker is back (its
  heartbeat again) it has written nothing into the finished jobs, which have not changed. And again healed while
  the other worker still runs them (`inference-overlap`): the returning worker writes nothing into jobs it no
  longer owns, and every entry is acknowledged once its job has ended.
- The same for a tokenizer worker holding delivered `jobs` entries: claimed, and tokenized exactly once.
- A master of a local Redis Cluster, with a client of its own, cut off from the majority until it is failed over:
  no write acknowledged on either side (SET, then WAIT 1 confirming a replica's copy, as conveyor's promises) is
  lost after the heal, and the minority side's writes are refused once they can no longer be copied
  (min-replicas-to-write 1, min-replicas-max-lag 1 s, cluster-node-timeout 2 s). Needs Debian's redis-server 7.

Each scenario starts a stack and a Redis of its own. Skipped where namespaces cannot be made (not root, no `ip`,
a kernel that refuses them). `.venv/bin/python -m bench faults partitions` repeats them (20 runs each by default)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import netns, partitions
from infra.redis_cluster import cluster_binary
from tests.conftest import TEST_ENV

pytestmark = pytest.mark.slow
SCENARIOS = ("api", "inference", "inference-overlap", "tokenizer", "cluster")


def why_not(scenario: str) -> str | None:
    """Why `scenario` cannot run here, or None."""
    reason = netns.unavailable()
    if reason or scenario != "cluster":
        return reason
    try:
        cluster_binary()
    except SystemExit as e:
        return str(e)
    return None


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_partition_loses_nothing_and_duplicates_nothing(tmp_path: Path, tiny_model_dir: str, scenario: str) -> None:
    reason = why_not(scenario)
    if reason:
        pytest.skip(reason)
    outcome = partitions.SCENARIOS[scenario](tmp_path, tiny_model_dir, TEST_ENV)
    assert outcome.accepted > 0, outcome
    assert outcome.passed, "\n".join([*outcome.problems, f"notes: {outcome.notes}"])
    assert outcome.lost == 0 and outcome.duplicated == 0, outcome
