"""Slot-based KV cache: one row per running sequence, rows kept dense so decode reads a view.

Layout per layer: [rows, kv_heads, capacity, head_dim]. Rows and capacity grow in steps as
sequences join and lengthen; a freed row is filled by moving the last row into it, so the
running sequences always occupy rows 0..n-1.
"""

from __future__ import annotations

import torch

ROW_STEP = 8
LEN_STEP = 128


def _round_up(x: int, step: int) -> int:
    return max(step, -(-x // step) * step)


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_len, self.dtype, self.device = max_len, dtype, device
        self.k = torch.zeros(num_layers, 0, kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.used = 0  # rows in use

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.k.element_size()

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def ensure(self, rows: int, length: int) -> None:
        """Make room for `rows` rows of `length` tokens each (grows, never shrinks while in use)."""
        need_rows = _round_up(rows, ROW_STEP) if rows > self.rows else self.rows
        need_len = min(self.max_len, _round_up(length, LEN_STEP)) if length > self.capacity else self.capacity
        if need_rows == self.rows and need_len == self.capacity:
            return
        shape = (self.num_layers, need_rows, self.kv_heads, need_len, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        keep = min(self.used, self.rows)
        if keep:
            k[:, :keep, :, : self.capacity] = self.k[:, :keep]
            v[:, :keep, :, : self.capacity] = self.v[:, :keep]
        self.k, self.v = k, v

    def shrink_if_idle(self) -> None:
        if self.used == 0 and self.rows:
            self.k = self.k.new_zeros(self.num_layers, 0, self.kv_heads, 0, self.head_dim)
            self.v = torch.zeros_like(self.k)

    def allocate(self) -> int:
        self.used += 1
        return self.used - 1

    def free(self, row: int) -> int | None:
        """Free a row; returns the row whose contents moved into it (now at `row`), if any."""
        last = self.used - 1
        self.used -= 1
        if row == last:
            return None
        self.k[:, row] = self.k[:, last]
        self.v[:, row] = self.v[:, last]
        return last
