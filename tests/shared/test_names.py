"""Partitions as keys name them: a job id names its partition, a tenant has one home, and a count set for a
block (`names.partitions_as`: a process that addresses a deployment other than its own) ends with it."""

from __future__ import annotations

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

