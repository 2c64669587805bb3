"""Priority within a tenant (vLLM's meaning: lower runs first). `waiting` is in priority order, then arrival;
a waiting sequence of a strictly better priority than one its tenant runs takes the slot of its tenant's worst
(the newest among equals) at once when every slot runs or blocks run short. The first tests drive the real
scheduler and block manager by hand (test_scheduler_fair.py's way: the scheduler decides, nothing is
computed); the last runs the tiny random model: the preempted sequence finishes with the tokens it makes alone."""

from __future__ import annotations

from gpu_worker.engine import EngineConfig, LLMEngine
from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.scheduler import FREE_SOON_STEPS, Scheduler
from gpu_worker.engine.sequence import SeqStatus, Sequence
from shared.schemas import Request
from tests.gpu_worker.engine.test_scheduler_fair import SLOTS, _run_step, _scheduler

BATCH, INTERACTIVE = 1000, 0  # workers/batch_driver.py submits its lines at PRIORITY_MAX


def _seq(name: str, priority: int, tenant: str = "t", max_tokens: int = 256, extra: int = 0) -> Sequence:
    # distinct prompts: identical ones would wait for each other's prefill (the prefix cache's sharing)
    return Sequence(Request(name, [ord(c) for c in name] + [1, 2, 3] + [4] * extra, max_tokens=max_tokens,
                            tenant=tenant, priority=priority))


def _full_of_batch_lines(sched: Scheduler, tenant: str = "t") -> list[Sequence]:
    lines = [_seq(f"b{i}", BATCH, tenant) for i in range(SLOTS)]
    for s in lines:
        sched.add(s)
    assert _run_step(sched) == [s.id for s in lines]
    return lines


def test_waiting_is_in_priority_order_then_arrival() -> None:
    sched = _scheduler()
    for name, priority in [("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)]:
        sched.add(_seq(name, priority))
    assert [s.id for s in sched.waiting] == ["d", "b", "e", "a", "c"]


def test_a_better_priority_takes_the_slot_of_its_tenants_worst_and_newest() -> None:
    sched = _scheduler()
    for name, priority in [("m0", 500), ("b0", BATCH), ("m1", 500), ("b1", BATCH)]:
        sched.add(_seq(name, priority))
    assert _run_step(sched) == ["m0", "m1", "b0", "b1"]  # admitted in priority order
    later = _seq("b2", BATCH)
    sched.add(later)
    urgent = _seq("urgent", INTERACTIVE)
    sched.add(urgent)
    assert [s.id for s in sched.waiting] == ["urgent", "b2"]
    running = _run_step(sched)
    assert "urgent" in running and "b1" not in running  # the worst priority, the newest of the two
    b1 = sched.waiting[0]
    assert b1.id == "b1" and b1.status is SeqStatus.WAITING and b1.num_computed == 0  # recomputed later
    assert [s.id for s in sched.waiting] == ["b1", "b2"]  # back at the front of its priority
    assert (sched.num_priority_preemptions, sched.num_fair_preemptions) == (1, 0)


def test_a_preempted_sequence_goes_back_behind_better_priorities() -> None:
    sched = _scheduler()
    lines = _full_of_batch_lines(sched)
    for name in ("u0", "u1"):
        sched.add(_seq(name, INTERACTIVE))
    assert "u0" in _run_step(sched)  # one a step: u1 is still ahead of the preempted line
    assert [s.id for s in sched.waiting] == ["u1", lines[-1].id]
    running = _run_step(sched)
    assert {"u0", "u1"} <= set(running) and [s.id for s in sched.waiting] == [lines[-2].id, lines[-1].id]
    assert sched.num_priority_preemptions == 2


def test_equal_priorities_never_preempt_each_other() -> None:
    for tenant, priority in (("t", BATCH), ("t", INTERACTIVE), ("", INTERACTIVE)):
        sched = _scheduler()
        for i in range(SLOTS):
            sched.add(_seq(f"b{i}", priority, tenant))
        _run_step(sched)
        sched.add(_seq("x", priority, tenant))
        assert "x" not in _run_step(sched)
        assert sched.num_preemptions == sched.num_priority_preemptions == sched.num_fair_preemptions == 0


def test_priority_preempts_only_within_a_tenant() -> None:
    """Tenant a's priority orders a's jobs, not b's: a's urgent job does not take the slot of b's batch line
    while a runs something of its own that is no worse (and a tenant running nothing has fair share)."""
    sched = _scheduler()
    for s in [_seq("b0", BATCH, "b"), _seq("b1", BATCH, "b"), _seq("b2", BATCH, "b"), _seq("a0", INTERACTIVE, "a")]:
        sched.add(s)
    _run_step(sched)
    sched.add(_seq("a1", INTERACTIVE, "a"))
    assert "a1" not in _run_step(sched) and sched.num_preemptions == 0


def test_a_better_priority_waits_for_a_slot_that_frees_soon_and_takes_it() -> None:
    """A running sequence within FREE_SOON_STEPS of its max_tokens: the urgent one preempts nobody and takes
    that slot when it frees, before the batch lines that waited longer."""
    sched = _scheduler()
    for i in range(SLOTS):
        sched.add(_seq(f"b{i}", BATCH, max_tokens=FREE_SOON_STEPS + 1 if i == 0 else 256))
    _run_step(sched)  # prefill: each has its first token; b0 ends within FREE_SOON_STEPS
    sched.add(_seq("b4", BATCH))
    sched.add(_seq("urgent", INTERACTIVE))
    steps = 0
    while "urgent" not in _run_step(sched):
        steps += 1
        assert steps <= FREE_SOON_STEPS and sched.num_preemptions == 0
        if sched.running[0].num_generated >= sched.running[0].req.max_tokens:
            sched.remove(sched.running[0])  # b0 reaches its max_tokens: the engine ends it
    assert sched.num_preemptions == 0 and [s.id for s in sched.waiting] == ["b4"]


def test_a_better_priority_takes_the_blocks_of_its_tenants_worst() -> None:
    """Slots are free but blocks are not: the urgent sequence takes the worse one's blocks."""
    sched = Scheduler(BlockManager(num_blocks=9, block_size=4), SLOTS, 256, 1024)  # 8 usable blocks
    for name in ("b0", "b1"):
        sched.add(_seq(name, BATCH, extra=9))  # 14 tokens, then 15: 4 blocks each
    assert _run_step(sched) == ["b0", "b1"] and sched.blocks.num_free == 0
    sched.add(_seq("u", INTERACTIVE))
    assert _run_step(sched) == ["b0", "u"] and sched.num_priority_preemptions == 1
    sched.add(_seq("v", BATCH))  # an equal priority waits for blocks, like anyone
    assert "v" not in _run_step(sched) and sched.num_priority_preemptions == 1


def test_a_better_priority_prefills_before_worse_ones_already_prefilling() -> None:
    """The step's token budget goes to prefill by priority: an urgent newcomer is not held behind batch lines
    whose long prompts take several steps; equal priorities keep their order (begun ones first)."""
    sched = Scheduler(BlockManager(num_blocks=64, block_size=4), SLOTS, 16, 1024)  # 16 tokens a step
    for name in ("b0", "b1"):
        sched.add(_seq(name, BATCH, extra=40))  # 45 tokens each: three steps of prefill
    assert _run_step(sched) == ["b0"]  # b0's first 16 tokens: no budget left to admit b1
    sched.add(_seq("u", INTERACTIVE))  # 4 tokens
    batch, _ = sched.schedule()
    assert [(s.id, n) for s, n in batch.chunks] == [("u", 4), ("b0", 12)]
    assert [s.id for s in sched.waiting] == ["b1"]  # an equal priority waits for the one begun


def test_an_urgent_request_runs_in_the_next_step_and_the_preempted_one_ends_the_same(tiny_model_dir: str) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, dtype="float32", max_num_seqs=SLOTS))
    prompts = {f"r{i}": [20 + i] * (12 + 5 * i) for i in range(SLOTS + 1)}

    def req(rid: str, priority: int) -> Request:
        return Request(rid, prompts[rid], max_tokens=48, temperature=0, ignore_eos=True, tenant="t", priority=priority)

    out: dict[str, list[int]] = {rid: [] for rid in prompts}

    def step() -> set[str]:
        outs = engine.step()
        for o in outs:
            assert o.error is None, o.error
            out[o.id] += o.token_ids
        return {o.id for o in outs if o.token_ids}

    alone = {}
    for rid in prompts:
        engine.add_request(req(rid, INTERACTIVE))
        while engine.has_unfinished():
            step()
        alone[rid], out[rid] = out[rid], []
    lines = [f"r{i}" for i in range(SLOTS)]
    for rid in lines:
        engine.add_request(req(rid, BATCH))
    while not all(out[rid] for rid in lines):  # every slot decoding a batch line
        step()
    engine.add_request(req(f"r{SLOTS}", INTERACTIVE))
    assert f"r{SLOTS}" in step()  # its first token in the very next step
    assert engine.scheduler.num_priority_preemptions == 1
    assert [s.id for s in engine.scheduler.waiting] == [lines[-1]]  # the newest line gave its slot
    while engine.has_unfinished():
        step()
    assert out == alone
    assert engine.blocks.num_used == 0
