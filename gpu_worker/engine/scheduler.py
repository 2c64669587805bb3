"""Which sequences run this step, and how many tokens each computes.

Two queues, as in nano-vllm: `waiting` (FIFO; preempted sequences go back to the front) and
`running` (admission order). Each step computes one token for every decoding sequence, then
spends what is left of the token budget on prefill chunks: first for sequences already
prefilling, then for new admissions. KV memory is accounted as the cache lays it out (rows
times the longest row); past the budget the newest running sequence is preempted and later
recomputed from its prompt plus the tokens it had produced.
"""

from __future__ import annotations

from collections import deque

from gpu_worker.engine.kv_cache import KVCache
from gpu_worker.engine.sequence import SeqStatus, Sequence
from gpu_worker.engine.step import StepBatch


class Scheduler:
    def __init__(self, cache: KVCache, max_num_seqs: int, max_num_batched_tokens: int,
                 kv_budget_tokens: int, max_model_len: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.kv_budget_tokens = kv_budget_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_slot: dict[int, Sequence] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_tokens(self) -> int:
        return len(self.running) * max((s.num_computed for s in self.running), default=0)

    def remove(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self._release(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        del self.by_slot[seq.slot]
        moved = self.cache.free(seq.slot)
        if moved is not None:
            other = self.by_slot.pop(moved)
            other.slot = seq.slot
            self.by_slot[seq.slot] = other
        seq.slot = -1

    def _admit(self, seq: Sequence) -> None:
        seq.slot = self.cache.allocate()
        self.by_slot[seq.slot] = seq
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> tuple[StepBatch, list[Sequence]]:
        """Returns the step's batch and the sequences that can never run (too long for the budget)."""
        rejected: list[Sequence] = []
        # decode rows need one more token of KV each; preempt the newest while that does not fit
        while self.running:
            longest = max(s.num_computed + 1 for s in self.running)
            if len(self.running) * longest <= self.kv_budget_tokens:
                break
            if len(self.running) == 1:
                rejected.append(self.running[0])
                self.remove(self.running[0])
                break
            self._preempt(self.running[-1])

        decode = [s for s in self.running if s.num_uncomputed == 1]
        budget = self.max_num_batched_tokens - len(decode)
        chunks: list[tuple[Sequence, int]] = []
        longest = max((s.num_computed + 1 for s in decode), default=0)
        for s in self.running:
            if s.num_uncomputed > 1 and budget > 0:
                n = min(s.num_uncomputed, budget)
                chunks.append((s, n))
                budget -= n
                longest = max(longest, s.num_computed + n)

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens >= self.max_model_len or seq.num_tokens + 1 > self.kv_budget_tokens:
                self.waiting.popleft()
                seq.status = SeqStatus.FINISHED
                rejected.append(seq)
                continue
            if (len(self.running) + 1) * max(longest, seq.num_tokens + 1) > self.kv_budget_tokens:
                break
            self.waiting.popleft()
            self._admit(seq)
            n = min(seq.num_uncomputed, budget)
            if seq.num_uncomputed == 1:
                decode.append(seq)
            else:
                chunks.append((seq, n))
            budget -= n
            longest = max(longest, seq.num_computed + n)

        self.cache.ensure(len(self.running), longest)
        decode.sort(key=lambda s: s.slot)
        return StepBatch(decode=decode, chunks=chunks), rejected
