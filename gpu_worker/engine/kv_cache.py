"""The paged KV cache: a pool of fixed-size blocks per layer, addressed by flat slot.

Layout per layer: [kv_heads, num_blocks * block_size, head_dim]; token t of a sequence lives at
slot `block_table[t // block_size] * block_size + t % block_size`. Heads first: a gather of the
slots a batch reads comes out as one contiguous [tokens, head_dim] run per head, the shape a
batched matmul over (head, sequence) takes as it is. Which sequence holds which
block is the block manager's business (block_manager.py). Block 0 is zero and never handed out:
reads padded to a common length point there, so padding never carries stale or non-finite values
into attention. The pool is allocated once, uninitialised, so memory is committed as blocks are
first written, up to the configured budget.
"""

from __future__ import annotations

import torch


def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, kv_heads, num_blocks * block_size, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, :, :block_size] = 0  # the null block
        self.v[:, :, :block_size] = 0
