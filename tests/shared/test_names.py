"""Partitions as keys name them: a job id names its partition, a tenant has one home, and a scoped count
(`names.partitions_as`) holds for its own thread only, so that a test naming a cluster's keys cannot move the
keys that the suite's background checks read meanwhile."""

from __future__ import annotations

import threading
import zlib

from shared import names


def test_a_job_id_names_its_partition_and_a_tenant_has_one_home() -> None:
    before = names.partition_count()  # REDIS_PARTITIONS (1 unless set)
    with names.partitions_as(12):
        assert list(names.partitions()) == list(range(12))
        for p in names.partitions():
            assert names.job_partition(names.job_id_in(p, "ab" * 16)) == p
        homes = {names.tenant_partition("acme") for _ in range(5)}
        assert len(homes) == 1 and names.new_job_partition("acme", "k1") in homes
        assert len({names.tenant_partition(f"t{i}") for i in range(200)}) == 12  # tenants spread over all
    assert names.partition_count() == before  # the block's end restores the deployment's count


def test_a_scoped_count_holds_in_its_own_thread_only() -> None:
    before = names.partition_count()
    inside, seen = threading.Event(), threading.Event()
    other: list[int] = []

    def read_meanwhile() -> None:
        inside.wait(10)
        other.append(names.partition_count())
        other.append(names.tenant_partition("prio"))
        seen.set()

    reader = threading.Thread(target=read_meanwhile)
    reader.start()
    with names.partitions_as(before + 11):
        inside.set()
        assert seen.wait(10)
        assert names.tenant_partition("prio") == zlib.crc32(b"prio") % (before + 11)
    reader.join()
    assert other == [before, zlib.crc32(b"prio") % before]
