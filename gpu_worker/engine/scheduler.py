"""Which sequences run this step, and how many tokens each computes.

Two queues, as in nano-vllm: `waiting` (FIFO; preempted sequences go back to the front) and
`running` (admission order). Each step computes one token for every decoding sequence, then spends
what is left of the token budget on prefill chunks: first for sequences already prefilling, then
for new admissions. KV memory is counted in blocks (block_manager.py): a sequence is admitted
when blocks for all its tokens are free (prefix-cache hits cost none), and a decoding sequence
takes a new block at each block boundary. When none is free, the newest running sequence is
preempted (its blocks freed) and later recomputed from its prompt plus the tokens it had produced,
much of it usually from the prefix cache.

A waiting sequence whose prompt shares full blocks with one still being prefilled (another choice of the
same prompt, a long common system prompt) waits until those are computed and takes them from the prefix
cache, rather than computing them twice side by side; the others behind it go on being admitted.

Fair share (shared/fair_queue.py decides which jobs reach an engine) also needs a slot for a newcomer:
when every slot runs and a waiting sequence's tenant runs nothing here, the newest sequence of the tenant
running the most (if it runs two or more) is preempted, and the newcomer goes first, unless a running
sequence ends within FREE_SOON_STEPS anyway. A light tenant then waits at most that many steps for a slot,
not for a heavy tenant's running job to end. Requests without a tenant (or all
of one tenant) never preempt each other this way.
"""

from __future__ import annotations

from collections import Counter, deque

from gpu_worker.engine.block_manager import BlockManager
from gpu_worker.engine.sequence import SeqStatus, Sequence
from gpu_worker.engine.step import StepBatch

# a newcomer waits for a slot rather than preempting when a running sequence ends within this many steps
# (at its max_tokens at the latest)
FREE_SOON_STEPS = 16


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_fair_preemptions = 0  # of those, made for a tenant that ran nothing (_make_room)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

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
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _make_room(self) -> None:
        """With every slot running: a waiting sequence whose tenant runs nothing here takes the slot of the
        newest sequence of the tenant running the most (two or more), which waits behind it."""
        if len(self.running) < self.max_num_seqs or not self.waiting:
            return
        running = Counter(s.req.tenant for s in self.running)
        newcomer = next((s for s in self.waiting if s.req.tenant and not running[s.req.tenant]), None)
        if newcomer is None:
            return
        if min(s.req.max_tokens - s.num_generated for s in self.running) <= FREE_SOON_STEPS:
            return  # a slot frees within that many steps anyway: recomputing a victim would cost more
        heaviest, n = running.most_common(1)[0]
        if n < 2 or not heaviest:
            return
        victim = next(s for s in reversed(self.running) if s.req.tenant == heaviest)
        self._preempt(victim)
        self.num_fair_preemptions += 1
        self.waiting.remove(newcomer)
        self.waiting.appendleft(newcomer)

    def _fits_ever(self, seq: Sequence) -> bool:
        return (seq.num_tokens < self.max_model_len
                and self.blocks.blocks_for(seq.num_tokens + 1) <= self.blocks.usable_blocks)

    def schedule(self) -> tuple[StepBatch, list[Sequence]]:
        """Returns the step's batch and the sequences that can never run (too long for the cache)."""
        rejected: list[Sequence] = []
        decode: list[Sequence] = []
        self._make_room()  # before anything is scheduled: its victim must not be in this step
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or seq.num_uncomputed != 1:
                continue
            while not self.blocks.can_append(seq):  # no block for its next token: preempt the newest
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    rejected.append(seq)
                    self.remove(seq)
                    break
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                self.blocks.append(seq)
                decode.append(seq)

        budget = self.max_num_batched_tokens - len(decode)
        chunks: list[tuple[Sequence, int]] = []
        for s in self.running:
            if s.num_uncomputed > 1 and budget > 0:
                n = min(s.num_uncomputed, budget)
                chunks.append((s, n))
                budget -= n

        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._fits_ever(seq):
                self.waiting.popleft()
                seq.status = SeqStatus.FINISHED
                rejected.append(seq)
                continue
            if self._prefix_pending(seq):
                deferred.append(self.waiting.popleft())
                continue
            if not self.blocks.allocate(seq):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            if seq.num_uncomputed == 1:
                decode.append(seq)
            else:
                chunks.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return StepBatch(decode=decode, chunks=chunks), rejected

    def _prefix_pending(self, seq: Sequence) -> bool:
        """Whether a running sequence is computing, and has not yet cached, full blocks this one would take
        from the prefix cache (the same prompt's other choices, a shared long system prompt): it then waits
        a step or more and takes them cached rather than computing them a second time beside it."""
        if not self.blocks.prefix_caching or seq.prompt_lp is not None:
            return False
        bs, ids = self.blocks.block_size, seq.token_ids
        for r in self.running:
            if r.num_computed >= r.num_tokens - 1:
                continue  # decoding: whatever it shares is cached already
            shared = 0
            limit = min(len(ids) - 1, r.num_tokens) // bs  # its last token's block is never taken from the cache
            while shared < limit and ids[shared * bs : (shared + 1) * bs] == r.token_ids[shared * bs:(shared + 1) * bs]:
                shared += 1
            if shared > r.num_computed // bs:
                return True
        return False
