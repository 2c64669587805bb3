"""KV-cache blocks: who holds which, and which prompt prefixes are cached (as in nano-vllm / vLLM).

The cache is a pool of fixed-size blocks; each sequence holds a block table (its blocks, in token
order). Block 0 is reserved and stays zero: padded reads of the cache point at it.

Prefix caching: once a full block's K/V is computed, it is registered under a hash chained over
every token up to its end. A sequence joining later takes registered blocks for the longest
matching prefix of its tokens instead of computing them (a shared system prompt, the earlier turns
of a chat). Blocks are reference-counted; a block nobody holds stays cached until its space is
needed, and then the least recently released one is reused first (LRU). Token ids are kept with
each cached block and compared on a hit, so a hash collision can never serve the wrong K/V.
A sequence under a LoRA adapter starts its chain from the adapter's salt (`Sequence.hash_seed`): K/V computed
under an adapter serve only sequences under the same adapter, and the base's only the base's.

`by_kind`: where the model computes a generated position's K/V in other bits than a prompt position's
(model_runner.py, `generated_by_decode`), a block past its sequence's prompt is cached under a hash that
also holds where that prompt ended: a later prompt made of the same tokens (the next turn of a chat)
computes them as prompt, as it would with nothing cached.
"""

from __future__ import annotations

from collections import OrderedDict

from gpu_worker.engine.sequence import Sequence

NULL_BLOCK = 0


def chain_hash(prev: int, tokens: tuple[int, ...], prompt: int = -1) -> int:
    """`prompt`: of the block's positions, how many are its sequence's prompt, where not all (`by_kind`)."""
    return hash((prev, tokens)) if prompt < 0 else hash((prev, tokens, prompt))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, by_kind: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.by_kind = by_kind
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.clean = list(range(num_blocks - 1, NULL_BLOCK, -1))  # never-cached free blocks; pop() gives the lowest
        self.cached_free: OrderedDict[int, int] = OrderedDict()  # cached, held by nobody, to its hash; oldest first
        self.hits = 0  # prompt tokens served from the cache (cumulative)
        self.queried = 0  # prompt tokens looked up (cumulative)

    # --- accounting ---------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.clean) + len(self.cached_free)

    @property
    def num_used(self) -> int:
        return self.usable_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix lookup ------------------------------------------------------------------------
    def _matches(self, seq: Sequence) -> tuple[list[int], int]:
        """Registered blocks holding the longest prefix of the sequence's tokens, and the last one's hash (0 for
        none). The block with the last token is never taken: that token is computed, to get the logits to sample
        from."""
        if not self.prefix_caching or (seq.prompt_lp is not None and len(seq.prompt_lp) < seq.num_prompt - 1):
            return [], 0  # its prompt's logprobs are wanted (echo): every prompt position is computed
        bs, ids = self.block_size, seq.token_ids
        found: list[int] = []
        h = seq.hash_seed
        last = 0
        for i in range((len(ids) - 1) // bs):
            tokens = tuple(ids[i * bs : (i + 1) * bs])
            h = chain_hash(h, tokens, self._prompt_part(seq, i))
            block = self.by_hash.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            found.append(block)
            last = h
        return found, last

    # --- allocation ---------------------------------------------------------------------------
    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, cached ones first; False (and nothing
        taken) when the free blocks do not suffice."""
        assert not seq.block_table
        hits, last_hash = self._matches(seq)
        need = self.blocks_for(seq.num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.ref[b] == 0)  # cached blocks that leave the free pool
        if need + revived > self.num_free:
            return False
        for b in hits:
            if self.ref[b] == 0:
                del self.cached_free[b]
            self.ref[b] += 1
        seq.block_table = hits + [self._take() for _ in range(need)]
        seq.num_hashed_blocks = len(hits)
        seq.last_block_hash = last_hash
        seq.num_computed = len(hits) * self.block_size
        self.queried += seq.num_tokens
        self.hits += seq.num_computed
        return True

    def can_append(self, seq: Sequence) -> bool:
        """Whether the sequence's next token has room (a new block is needed at a block boundary)."""
        return seq.num_tokens <= len(seq.block_table) * self.block_size or self.num_free > 0

    def append(self, seq: Sequence) -> None:
        """Make room for the sequence's newest token (call after `can_append`)."""
        if seq.num_tokens > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take())

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Blocks for the sequence's first `num_tokens` positions (its draft's, beyond its tokens), if
        enough are free; False, and nothing taken, if not. Blocks past what it later keeps stay its own."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            return False
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):  # the prefix's head is released last: evicted last
            self.ref[b] -= 1
            if self.ref[b] == 0:
                h = self.block_hash[b]
                if h is not None:
                    self.cached_free[b] = h
                else:
                    self.clean.append(b)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def register(self, seq: Sequence) -> None:
        """Cache the sequence's full blocks whose K/V is now computed."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed, seq.num_tokens) // bs
        h = seq.last_block_hash if seq.num_hashed_blocks else seq.hash_seed
        for i in range(seq.num_hashed_blocks, full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(h, tokens, self._prompt_part(seq, i))
            block = seq.block_table[i]
            if h not in self.by_hash and self.block_hash[block] is None:
                self.by_hash[h] = block
                self.block_hash[block], self.block_tokens[block] = h, tokens
            seq.last_block_hash = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def _prompt_part(self, seq: Sequence, block: int) -> int:
        """`chain_hash`'s `prompt` for the sequence's block: -1 for a block of its prompt alone (or not `by_kind`)."""
        part = seq.num_prompt - block * self.block_size
        return -1 if not self.by_kind or part >= self.block_size else max(part, 0)

    def _take(self) -> int:
        if self.clean:
            block = self.clean.pop()
        else:
            block, h = self.cached_free.popitem(last=False)  # the least recently released cached block
            del self.by_hash[h]
            self.block_hash[block] = self.block_tokens[block] = None
        self.ref[block] = 1
        return block
