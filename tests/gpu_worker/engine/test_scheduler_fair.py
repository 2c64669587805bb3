"""The scheduler gives a tenant that runs nothing a slot at once: with every slot taken by one tenant, a
newcomer of another tenant preempts that tenant's newest sequence instead of waiting for one to end. The
real scheduler and block manager, sequences driven by hand (no model: the scheduler decides, it computes
nothing)."""

from __future__ import annotations

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.scheduler import FREE_SOON_STEPS, Scheduler
from gpu_worker.engine.sequence import SeqStatus, Sequence
from gpu_worker.engine.step import StepBatch
from shared.schemas import Request

SLOTS = 4


def _seq(name: str, tenant: str, max_tokens: int = 256) -> Sequence:
    # distinct prompts: identical ones would wait for each other's prefill (the prefix cache's sharing)
    return Sequence(Request(name, [ord(c) for c in name] + [1, 2, 3], max_tokens=max_tokens, tenant=tenant))


def _run_step(sched: Scheduler) -> list[str]:
    """Schedule a step and account it as computed (one new token for each decoding sequence)."""
    batch, rejected = sched.schedule()
    assert not rejected
    _run_step_of(batch)
    return [s.id for s in sched.running]


def _run_step_of(batch: StepBatch) -> None:
    """Account a scheduled step as computed."""
    for seq, n in batch.chunks:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:  # its prompt is in: the step samples its first token
            seq.token_ids.append(7)
    for seq in batch.decode:
        seq.num_computed = seq.num_tokens
        seq.token_ids.append(7)


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


def _long(name: str, tenant: str, priority: int = 0, extra: int = 40) -> Sequence:
    return Sequence(Request(name, [ord(c) for c in name] + [1, 2, 3] + [4] * extra, max_tokens=1, tenant=tenant,
                            priority=priority))


def test_another_tenants_priority_does_not_hold_a_newcomer() -> None:
    """Priority orders a tenant's own jobs: tenant a's long prompts at priority -1000, always waiting, do not
    keep tenant b's job (priority 0) from the step's prefill budget. Before, the engine's one waiting queue was
    in priority order across tenants, and b's job waited for as long as a sent such prompts (a review: 399 s)."""
    sched = Scheduler(BlockManager(num_blocks=256, block_size=4), 8, 16, 1024)  # 16 tokens a step
    for i in range(4):
        sched.add(_long(f"a{i}", "a", priority=-1000))
    _run_step(sched)
    sched.add(_long("b0", "b", extra=0))
    batch, _ = sched.schedule()
    assert [s.id for s, _ in batch.chunks][:1] == ["b0"], batch.chunks


def test_a_light_tenants_job_is_not_held_behind_a_heavy_tenants_prompts() -> None:
    """At equal priorities, a tenant running nothing here goes before the prompts another tenant has waiting
    or under way: its job's first chunk comes in the next step, not after every prompt queued before it (a
    review: 16 s waiting for a slot behind 8 prompts of 4,000 tokens)."""
    sched = Scheduler(BlockManager(num_blocks=256, block_size=4), 8, 16, 1024)
    heavy = [_long(f"h{i}", "heavy") for i in range(4)]
    for s in heavy:
        sched.add(s)
    _run_step(sched)  # h0's first chunk
    sched.add(_long("l0", "light", extra=0))
    batch, _ = sched.schedule()
    assert [(s.id, n) for s, n in batch.chunks] == [("l0", 5), ("h0", 11)]  # each its share, the rest to h0
    assert [s.id for s in sched.waiting] == ["h1", "h2", "h3"]  # the heavy tenant's keep their order


def test_a_steps_prefill_goes_round_the_tenants() -> None:
    """Within a step too: after a tenant's job, the next of a tenant running fewer here; between tenants running
    as many, the one whose job came first."""
    sched = Scheduler(BlockManager(num_blocks=256, block_size=4), 8, 16, 1024)
    for s in (_long("x0", "x", extra=0), _long("x1", "x", extra=0), _long("y0", "y", extra=0)):
        sched.add(s)  # 5 tokens each: all three fit the step's 16
    batch, _ = sched.schedule()
    assert [s.id for s, _ in batch.chunks] == ["x0", "y0", "x1"]


def test_a_prefill_only_step_of_two_tenants_is_as_short_as_a_decode_step() -> None:
    """While nothing decodes, a step takes up to the larger prefill-only budget of one tenant's prompts; with a
    second tenant's prompt in it, no more than a decode step's: the light tenant's first token comes after a
    short step, not after the heavy tenant's next few thousand tokens of prompt."""
    sched = Scheduler(BlockManager(num_blocks=256, block_size=4), 8, 16, 1024, prefill_only_tokens=64)
    for s in (_long("h0", "heavy", extra=100), _long("h1", "heavy")):
        sched.add(s)
    batch, _ = sched.schedule()
    assert [(s.id, n) for s, n in batch.chunks] == [("h0", 64)]  # one tenant's: the whole 64
    _run_step_of(batch)
    sched.add(_long("l0", "light", extra=0))
    batch, _ = sched.schedule()
    assert [(s.id, n) for s, n in batch.chunks] == [("l0", 5), ("h0", 11)]  # 16 in all, not 64


def test_each_tenant_gets_a_share_of_a_step_whoever_goes_first() -> None:
    """Tenants with prompts to prefill share a step: the first one's turn takes at most its share, so a tenant
    that came after another's long prompts is not left to the next step, and the next, for as long as that tenant
    goes first (a light job admitted without a chunk waited 40 s behind 24 prompts of 4,000 tokens), however many
    prompts that tenant has; what is left of the step goes back to the chunks begun."""
    sched = Scheduler(BlockManager(num_blocks=256, block_size=4), 8, 16, 1024, prefill_only_tokens=64)
    sched.add(_long("h0", "heavy", extra=100))
    sched.add(_long("h1", "heavy", extra=100))
    sched.add(_long("l0", "light", extra=0))
    batch, _ = sched.schedule()
    assert [(s.id, n) for s, n in batch.chunks] == [("h0", 11), ("l0", 5)]  # h0 its share, then the rest
    _run_step_of(batch)
    batch, _ = sched.schedule()
    assert [s.id for s in batch.decode] == ["l0"]  # its first token came with the first step


def test_a_tenant_waiting_for_a_slot_does_not_shorten_the_steps() -> None:
    """Every slot taken: a tenant that cannot be admitted this step shares nothing, and the prompts under way keep the
    whole prefill-only step."""
    sched = Scheduler(BlockManager(num_blocks=256, block_size=4), 1, 16, 1024, prefill_only_tokens=64)
    sched.add(_long("h0", "heavy", extra=100))  # 105 tokens
    _run_step_of(sched.schedule()[0])
    sched.add(_long("l0", "light", extra=0))
    batch, _ = sched.schedule()
    assert [(s.id, n) for s, n in batch.chunks] == [("h0", 41)] and [s.id for s in sched.waiting] == ["l0"]


def test_a_tenants_share_is_its_turns_together() -> None:
    """A tenant with two prompts takes its share of the step in all, not a share per prompt: the other tenant's prompt
    under way, beside its decoding rows, goes on every step (it waited 26 steps, a review found)."""
    sched = Scheduler(BlockManager(num_blocks=512, block_size=4), 8, 16, 1024)
    for s in (_long("b0", "b", extra=0), _long("b1", "b", extra=0)):
        sched.add(s)
    _run_step_of(sched.schedule()[0])  # b0, b1: their first tokens
    for s in (Sequence(Request(n, [ord(n[0]), ord(n[1])] + [4] * 198, max_tokens=8, tenant=t)) for n, t in
              (("bp", "b"), ("a0", "a"), ("a1", "a"))):
        sched.add(s)
    for _ in range(5):
        batch, _ = sched.schedule()
        assert len(batch.decode) == 2 and any(s.id == "bp" for s, _ in batch.chunks), batch.chunks
        assert sum(n for s, n in batch.chunks if s.req.tenant == "a") <= 7
        _run_step_of(batch)


def test_a_tenant_whose_prompt_cannot_start_does_not_shorten_the_steps() -> None:
    """A tenant whose only prompt cannot start this step shares nothing: one waiting for another's prefix to be
    computed (it takes those blocks cached), or for blocks to be free. The prompt under way keeps the whole
    prefill-only step (before, each such tenant halved it to a decode step's size, for nothing)."""
    sched = Scheduler(BlockManager(num_blocks=256, block_size=4), 8, 16, 1024, prefill_only_tokens=64)
    h0 = _long("h0", "heavy", extra=100)
    sched.add(h0)
    _run_step_of(sched.schedule()[0])
    sched.add(Sequence(Request("l0", list(h0.token_ids[:80]) + [9, 9], max_tokens=8, tenant="light")))  # h0's prefix
    batch, _ = sched.schedule()
    assert [(s.id, n) for s, n in batch.chunks] == [("h0", 41)] and [s.id for s in sched.waiting] == ["l0"]

    sched = Scheduler(BlockManager(num_blocks=40, block_size=4), 8, 16, 1024, prefill_only_tokens=64)
    sched.add(_long("h0", "heavy", extra=100))  # 105 tokens: 27 of the 40 blocks
    _run_step_of(sched.schedule()[0])
    sched.add(_long("l0", "light", extra=60))  # 65 tokens: 17 blocks, 13 free
    batch, _ = sched.schedule()
    assert [(s.id, n) for s, n in batch.chunks] == [("h0", 41)] and [s.id for s in sched.waiting] == ["l0"]


def test_with_admit_every_new_prompts_wait_while_others_decode_and_start_together() -> None:
    """ADMIT_EVERY_STEPS=3: while a sequence decodes, prompts that arrive start together on the third step after the
    last admission, not each on the step after it came; with nothing decoding, a prompt starts at once."""
    sched = Scheduler(BlockManager(num_blocks=64, block_size=4), SLOTS, 256, 1024, admit_every=3)
    sched.add(_seq("a", "t"))
    assert _run_step(sched) == ["a"]  # nothing decoded: at once
    sched.add(_seq("b", "t"))
    assert _run_step(sched) == ["a"]  # held: 1
    sched.add(_seq("c", "t"))
    assert _run_step(sched) == ["a"]  # held: 2
    assert _run_step(sched) == ["a", "b", "c"]  # the third: both at once
    sched.add(_seq("d", "t"))
    assert [_run_step(sched) for _ in range(3)][-1] == ["a", "b", "c", "d"]
    default = _scheduler()
    default.add(_seq("a", "t"))
    _run_step(default)
    default.add(_seq("b", "t"))
    assert _run_step(default) == ["a", "b"]  # admit_every 1 (the default): on the next step
