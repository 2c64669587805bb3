"""The scheduler gives a tenant that runs nothing a slot at once: with every slot taken by one tenant, a
newcomer of another tenant preempts that tenant's newest sequence instead of waiting for one to end. The
real scheduler and block manager, sequences driven by hand (no model: the scheduler decides, it computes
nothing)."""

from __future__ import annotations

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.scheduler import FREE_SOON_STEPS, Scheduler
from gpu_worker.engine.sequence import SeqStatus, Sequence
from shared.schemas import Request

SLOTS = 4


def _seq(name: str, tenant: str, max_tokens: int = 256) -> Sequence:
    # distinct prompts: identical ones would wait for each other's prefill (the prefix cache's sharing)
    return Sequence(Request(name, [ord(c) for c in name] + [1, 2, 3], max_tokens=max_tokens, tenant=tenant))


def _run_step(sched: Scheduler) -> list[str]:
    """Schedule a step and account it as computed (one new token for each decoding sequence)."""
    batch, rejected = sched.schedule()
    assert not rejected
    for seq, n in batch.chunks:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:  # its prompt is in: the step samples its first token
            seq.token_ids.append(7)
    for seq in batch.decode:
        seq.num_computed = seq.num_tokens
        seq.token_ids.append(7)
    return [s.id for s in sched.running]


def _scheduler() -> Scheduler:
    return Scheduler(BlockManager(num_blocks=64, block_size=4), SLOTS, 256, 1024)


def test_a_newcomer_takes_the_newest_slot_of_the_tenant_running_the_most() -> None:
    sched = _scheduler()
    heavy = [_seq(f"h{i}", "heavy") for i in range(6)]
    for s in heavy:
        sched.add(s)
    assert _run_step(sched) == ["h0", "h1", "h2", "h3"]
    light = _seq("l0", "light")
    sched.add(light)
    running = _run_step(sched)
    assert "l0" in running and "h3" not in running  # the newest heavy sequence gave its slot
    assert heavy[3].status is SeqStatus.WAITING and heavy[3].num_computed == 0  # recomputed later
    assert [s.id for s in sched.waiting][:1] == ["h3"]  # and it runs next, before the heavy ones never started
    assert sched.num_fair_preemptions == 1


def test_no_preemption_within_one_tenant_or_without_tenants() -> None:
    for tenant in ("heavy", ""):
        sched = _scheduler()
        for i in range(6):
            sched.add(_seq(f"h{i}", tenant))
        _run_step(sched)
        sched.add(_seq("x", tenant))
        assert "x" not in _run_step(sched) and sched.num_fair_preemptions == 0


def test_a_tenant_already_running_waits_its_turn() -> None:
    """The light tenant has a slot: its second job waits for a slot to free like anyone's."""
    sched = _scheduler()
    for i in range(3):
        sched.add(_seq(f"h{i}", "heavy"))
    sched.add(_seq("l0", "light"))
    _run_step(sched)
    sched.add(_seq("l1", "light"))
    assert "l1" not in _run_step(sched) and sched.num_fair_preemptions == 0


def test_no_preemption_when_a_slot_frees_soon_anyway() -> None:
    """A running sequence within FREE_SOON_STEPS of its max_tokens: the newcomer waits for its slot."""
    sched = _scheduler()
    for i in range(SLOTS):
        sched.add(_seq(f"h{i}", "heavy", max_tokens=FREE_SOON_STEPS + 2 if i == 0 else 256))
    _run_step(sched)  # prefill: each has its first token; h0 ends within FREE_SOON_STEPS + 1
    sched.add(_seq("l0", "light"))
    assert "l0" in _run_step(sched) and sched.num_fair_preemptions == 1  # not soon enough: l0 takes a slot
    sched = _scheduler()
    for i in range(SLOTS):
        sched.add(_seq(f"h{i}", "heavy", max_tokens=FREE_SOON_STEPS + 1 if i == 0 else 256))
    _run_step(sched)  # h0 ends within FREE_SOON_STEPS
    sched.add(_seq("l0", "light"))
    assert "l0" not in _run_step(sched) and sched.num_fair_preemptions == 0
