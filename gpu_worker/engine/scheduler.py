"""Which sequences run this step, and how many tokens each computes.

Two queues, as in nano-vllm: `waiting` and `running` (admission order). `waiting` is ordered by priority
(lower first, vLLM's meaning), then arrival; a preempted sequence goes back at the front of its priority.
Each step computes one token for every decoding sequence, then its draft tokens (speculation, ngram.py: in
order, while the budget lasts and free blocks hold them; a draft never preempts), then spends what is left of
the token budget on prefill chunks, tenant by tenant (`_Turns`): next the tenant given the least of the step so far,
then the one running the fewest sequences here, then the one whose next sequence came first; within a tenant by
priority, and within a priority first for sequences already prefilling, then for new admissions. With several
tenants' prompts to prefill (a waiting one counted when it could start now), a step is as short as a decode step
(the larger prefill-only budget is for one tenant's prompts) and a tenant's turns together take at most its share of
it, what is left going back to the chunks begun.
So a light tenant's job is not held behind a heavy tenant's long prompts, nor behind its priorities: a tenant's
priority orders its own jobs. While sequences decode, waiting prompts may be held to start together on every
`admit_every`-th step (ADMIT_EVERY_STEPS, 4 in the service): a step that carries a prompt's chunk is a longer one for
every decoding row, so fewer such steps mean a shorter inter-token latency for a few steps more to the first token.
(Which tenants' jobs reach a worker is the fair queue's choice, shared/fair_queue.py; a worker holds up to its
slots plus an eighth, so one tenant's prompts can be many of those waiting here.) KV memory is counted in blocks
(block_manager.py): a sequence is admitted when blocks for all its tokens are free (prefix-cache hits cost
none), and a decoding sequence takes a new block at each block boundary. When none is free, the newest
sequence's tenant gives one up: its sequence of the worst priority (the newest among equals) is preempted,
its blocks freed, and later recomputed from its prompt plus the tokens it had produced, much of it usually
from the prefix cache.

A waiting sequence whose prompt shares full blocks with one still being prefilled (another choice of the
same prompt, a long common system prompt) waits until those are computed and takes them from the prefix
cache, rather than computing them twice side by side; the others behind it go on being admitted.

A waiting sequence that cannot start (every slot runs, or too few blocks are free) may take the place of one
running (`_make_room`, one a step), its victim (`_victim`):
- priority: of its own tenant, the running sequence of the worst priority (the newest among equals), if that
  is strictly worse than its own. A batch's lines (priority 1000, workers/batch_driver.py) give their slots to the
  same tenant's interactive requests (0). Equal priorities never preempt each other.
- fair share: if its tenant runs nothing here, the same of the tenant running the most, if that runs two or
  more. A light tenant waits for a slot, not for a heavy tenant's running job to end.
Priority preempts only within a tenant: a tenant's priorities never cost another tenant a running job. The
sequence given a victim goes first; when a running sequence ends within FREE_SOON_STEPS anyway, it waits for that
slot instead and nobody is preempted. Requests without a tenant count as one tenant here.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.sequence import SeqStatus, Sequence
from gpu_worker.engine.step import StepBatch

# a sequence given a victim waits for a slot rather than preempting when a running sequence ends within this
# many steps (at its max_tokens at the latest): recomputing the victim would cost more
FREE_SOON_STEPS = 16


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, prefill_only_tokens: int = 0, admit_every: int = 1) -> None:
        """`max_num_batched_tokens`: tokens a step computes while some sequence decodes (a prefill chunk stalls
        each decoding row for as long as it takes); `prefill_only_tokens`: while none does (0: the same);
        `admit_every`: while some sequence decodes, waiting prompts start together, on every `admit_every`-th step
        at most (1: on every step), so that fewer of the decoding rows' steps carry a prompt's chunk."""
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.prefill_only_tokens = max(prefill_only_tokens, self.max_num_batched_tokens)
        self.max_model_len = max_model_len
        self.admit_every = max(1, admit_every)
        self._held = 0  # steps in a row that held waiting prompts back while sequences decoded (`admit_every`)
        self.waiting: deque[Sequence] = deque()  # by priority, then arrival (each tenant's order)
        self._arrivals = 0
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # of those, made by _make_room: for a tenant that ran nothing, for a better priority of the same tenant
        self.num_fair_preemptions = 0
        self.num_priority_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._arrivals += 1
        seq.arrival = self._arrivals
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence, first: bool = False) -> None:
        """Into `waiting` after the sequences of a better or equal priority (`first`: before its equals)."""
        p = seq.req.priority
        if not self.waiting or self.waiting[-1].req.priority < p or (not first and self.waiting[-1].req.priority == p):
            self.waiting.append(seq)
            return
        at = next(i for i, w in enumerate(self.waiting) if w.req.priority > p or (first and w.req.priority == p))
        self.waiting.insert(at, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.blocks.free(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        seq.draft = []
        self.num_preemptions += 1
        if seq.timeline is not None:
            seq.timeline.append(("preempted", time.time(), seq.num_generated))
        self._enqueue(seq, first=True)

    def _worst(self) -> dict[str, Sequence]:
        """Per tenant running here, the sequence it gives up first: of its worst priority, the newest."""
        worst: dict[str, Sequence] = {}
        for s in self.running:  # admission order: a later one of an equal priority replaces an earlier
            w = worst.get(s.req.tenant)
            if w is None or s.req.priority >= w.req.priority:
                worst[s.req.tenant] = s
        return worst

    def _victim(self, seq: Sequence, running: Counter[str], worst: dict[str, Sequence]) -> Sequence | None:
        """The running sequence `seq` may take the place of, if any: its tenant's worst, when of a strictly
        worse priority (priority); or, when its tenant runs nothing here, the worst of the tenant running the
        most, when that runs two or more (fair share)."""
        tenant = seq.req.tenant
        if running[tenant]:
            own = worst[tenant]
            return own if own.req.priority > seq.req.priority else None
        heaviest, n = running.most_common(1)[0]
        return worst[heaviest] if tenant and heaviest and n >= 2 else None

    def _blocked(self, seq: Sequence) -> bool:
        """Whether the sequence cannot start now: every slot runs, or fewer blocks are free than its tokens
        need (counting none from the prefix cache: a guess on the safe side)."""
        return (len(self.running) >= self.max_num_seqs
                or self.blocks.blocks_for(seq.num_tokens) > self.blocks.num_free)

    def _make_room(self) -> None:
        """The first waiting sequence that cannot start but has a victim goes first (the head of its tenant's turns),
        into the victim's slot (preempted, it waits at the front of its priority), or into the slot of a running
        sequence that ends within FREE_SOON_STEPS."""
        if not self.waiting or not self.running:
            return
        running, worst = Counter(s.req.tenant for s in self.running), self._worst()
        for seq in self.waiting:
            victim = self._victim(seq, running, worst) if self._blocked(seq) else None
            if victim is not None:
                break
        else:
            return
        if min(s.req.max_tokens - s.num_generated for s in self.running) > FREE_SOON_STEPS:
            self._preempt(victim)
            if victim.req.tenant == seq.req.tenant:
                self.num_priority_preemptions += 1
            else:
                self.num_fair_preemptions += 1
        self.waiting.remove(seq)
        self.waiting.appendleft(seq)

    def _can_start(self, seq: Sequence) -> bool:
        """Whether a waiting sequence could start this step: it fits, blocks for it are free, and it is not waiting
        for another's prefix."""
        return self._fits_ever(seq) and not self._blocked(seq) and not self._prefix_pending(seq)

    def _fits_ever(self, seq: Sequence) -> bool:
        return (seq.num_tokens < self.max_model_len
                and self.blocks.blocks_for(seq.num_tokens + 1) <= self.blocks.usable_blocks)

    def schedule(self) -> tuple[StepBatch, list[Sequence]]:
        """Returns the step's batch and the sequences that can never run (too long for the cache)."""
        rejected: list[Sequence] = []
        hold = (self._held + 1 < self.admit_every and bool(self.waiting)
                and any(s.decoding for s in self.running))  # new prompts wait to start together (`admit_every`)
        self._held = self._held + 1 if hold else 0
        if not hold:
            self._make_room()  # before anything is scheduled: its victim must not be in this step
        decode = self._decodes(rejected)
        turns = _Turns(self.running, self.waiting)
        sharing = turns.tenants(len(self.running) < self.max_num_seqs and not hold, self._can_start)  # with a prompt
        # the larger prefill-only step is for one tenant's prompts; with several, a step is as short as a decode
        # step, and each tenant's turn takes at most its share of it (what is left then goes to the chunks begun)
        limit = self.prefill_only_tokens if not decode and sharing < 2 else self.max_num_batched_tokens
        budget = limit - len(decode)
        share = max(1, budget // sharing) if sharing > 1 else budget
        chunks: list[tuple[Sequence, int]] = []
        admitting = not hold
        while budget > 0:
            admitting = admitting and len(self.running) < self.max_num_seqs
            seq = turns.next(admitting)
            if seq is None:
                break
            room = share - turns.given[seq.req.tenant]
            if room <= 0:  # its tenant's share of the step is taken (the others' too: it came last)
                continue
            if seq.status is SeqStatus.WAITING:
                if not self._fits_ever(seq):
                    self.waiting.remove(seq)
                    seq.status = SeqStatus.FINISHED
                    rejected.append(seq)
                    continue
                if self._prefix_pending(seq):  # (it waits in its place)
                    continue
                if not self.blocks.allocate(seq):
                    admitting = False  # (it keeps its place: no smaller one is admitted past it)
                    continue
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                turns.started(seq)
                seq.scheduled_at = seq.scheduled_at or time.time()
                if seq.decoding:  # (a resumed job whose prompt and ids but its last were cached)
                    decode.append(seq)
                    budget -= 1
                    continue
            n = min(seq.num_uncomputed, budget, room)
            chunks.append((seq, n))
            turns.given[seq.req.tenant] += n
            budget -= n
        for i, (seq, n) in enumerate(chunks):  # the budget shares left, to the chunks that could take more
            more = min(seq.num_uncomputed - n, max(budget, 0))
            chunks[i] = (seq, n + more)
            budget -= more
            if seq.timeline is not None:
                seq.timeline.append(("prefill_chunk", time.time(), n + more))
        for seq in decode:  # draft tokens (speculation: a bet) after prefill, while budget and free blocks last
            if seq.draft:
                seq.draft = seq.draft[: max(budget, 0)]
                if seq.draft and not self.blocks.reserve(seq, seq.num_tokens + len(seq.draft)):
                    seq.draft = []
                budget -= len(seq.draft)
        return StepBatch(decode=decode, chunks=chunks), rejected

    def _decodes(self, rejected: list[Sequence]) -> list[Sequence]:
        """The running sequences that decode this step, each with a block for its next token: where none is free,
        the newest's tenant gives one up (preempted); a sequence alone that still finds none is `rejected`."""
        decode: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or not seq.decoding:
                continue
            while not self.blocks.can_append(seq):
                victim = self._worst()[self.running[-1].req.tenant]
                if victim is seq and len(self.running) == 1:
                    rejected.append(seq)
                    self.remove(seq)
                    break
                self._preempt(victim)
                if victim in decode:  # scheduled already this step: no longer
                    decode.remove(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                self.blocks.append(seq)
                decode.append(seq)
        return decode

    def _prefix_pending(self, seq: Sequence) -> bool:
        """Whether a running sequence is computing, and has not yet cached, full blocks this one would take
        from the prefix cache (the same prompt's other choices, a shared long system prompt): it then waits
        a step or more and takes them cached rather than computing them a second time beside it."""
        if not self.blocks.prefix_caching or seq.prompt_lp is not None:
            return False
        bs, ids = self.blocks.block_size, seq.token_ids
        for r in self.running:
            if r.num_computed >= r.num_tokens - 1 or r.hash_seed != seq.hash_seed:
                continue  # decoding: whatever it shares is cached already; or under another adapter: it never will be
            shared = 0
            limit = min(len(ids) - 1, r.num_tokens) // bs  # its last token's block is never taken from the cache
            while shared < limit and ids[shared * bs : (shared + 1) * bs] == r.token_ids[shared * bs:(shared + 1) * bs]:
                shared += 1
            if shared > r.num_computed // bs:
                return True
        return False


class _Turns:
    """Whose prefill is next in a step: the tenant given the fewest tokens of it so far, then the one running the
    fewest sequences here (those started in the step counted), then the one whose next sequence came first; a
    tenant's next is its best priority's, and within one its sequences already prefilling before new admissions (a
    sequence made room for is the head of its tenant's waiting ones)."""

    def __init__(self, running: list[Sequence], waiting: deque[Sequence]) -> None:
        self.running = Counter(s.req.tenant for s in running)
        self.given: Counter[str] = Counter()  # tokens of the step so far, by tenant
        self.prefilling: dict[str, deque[Sequence]] = {}
        for s in sorted((s for s in running if s.num_uncomputed and not s.decoding),
                        key=lambda s: (s.req.priority, s.arrival)):
            self.prefilling.setdefault(s.req.tenant, deque()).append(s)
        self.waiting: dict[str, deque[Sequence]] = {}
        for s in waiting:  # (in priority order, then arrival: each tenant's too)
            self.waiting.setdefault(s.req.tenant, deque()).append(s)

    def next(self, admitting: bool) -> Sequence | None:
        """The next sequence to prefill (a waiting one only while `admitting`), taken off the turns; None when
        none is left."""
        best: tuple[tuple[int, int, int], dict[str, deque[Sequence]], str] | None = None
        for tenant in self.prefilling.keys() | (self.waiting.keys() if admitting else set()):
            queues = self._head(tenant, admitting)
            key = (self.given[tenant], self.running[tenant], queues[tenant][0].arrival)
            if best is None or key < best[0]:
                best = (key, queues, tenant)
        if best is None:
            return None
        _, queues, tenant = best
        seq = queues[tenant].popleft()
        if not queues[tenant]:
            del queues[tenant]
        return seq

    def _head(self, tenant: str, admitting: bool) -> dict[str, deque[Sequence]]:
        """Which of the tenant's queues (prefilling, waiting) goes next: a waiting sequence of a strictly better
        priority before those prefilling."""
        begun, new = self.prefilling.get(tenant), self.waiting.get(tenant) if admitting else None
        if begun and not (new and new[0].req.priority < begun[0].req.priority):
            return self.prefilling
        return self.waiting

    def started(self, seq: Sequence) -> None:
        self.running[seq.req.tenant] += 1

    def tenants(self, admitting: bool, can_start: Callable[[Sequence], bool]) -> int:
        """How many tenants have a prompt to prefill: begun, or (`admitting`: a slot is free) waiting, one of theirs
        able to start (`can_start`: not waiting for blocks or for another's prefix; asked only of several tenants)."""
        candidates = self.prefilling.keys() | (self.waiting.keys() if admitting else set())
        if len(candidates) < 2:
            return len(candidates)
        return sum(1 for t in candidates if t in self.prefilling or any(can_start(s) for s in self.waiting[t]))
