"""Static key/value cache for generation: preallocated, GQA layout, write position tracked here."""

from typing import Optional

import torch


class KVCache:
    """Keys and values of every layer, [num_layers, batch, num_kv_heads, max_seq_len, head_dim].

    The model writes a forward pass's keys/values at `pos` and advances `pos` after its last layer, so a
    prefill followed by one-token decode steps needs no bookkeeping by the caller. `key_mask` remembers which
    cached positions are real tokens (0 = left padding) so later steps keep ignoring the padding.
    """

    def __init__(self, num_layers, batch, max_seq_len, num_kv_heads, head_dim, dtype=torch.float32, device=None):
        shape = (num_layers, batch, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.key_mask = torch.ones(batch, max_seq_len, dtype=torch.bool, device=device)
        self.padded = False  # whether key_mask was ever written (else every cached position is a real token)
        self.max_seq_len = max_seq_len
        self.pos = 0

    def update(self, layer_id: int, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor):
        """Store this step's keys/values at the write position; return all cached ones up to and including them."""
        end = self.pos + k_BKSD.shape[2]
        self.k[layer_id, :, :, self.pos : end] = k_BKSD
        self.v[layer_id, :, :, self.pos : end] = v_BKSD
        return self.k[layer_id, :, :, :end], self.v[layer_id, :, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.pos += num_tokens


class SlotCache:
    """Continuous batching: `num_slots` rows of keys/values, each row one sequence at its own length.

    A forward pass runs on rows [0, num_rows) (`select`), every row adding the same number of tokens S at
    its own length; requests join by a prefill into a free row and leave between steps (`move` keeps the
    running rows contiguous, so a step reads a view of the cache, never a gathered copy).
    Layout as KVCache: [num_layers, num_slots, num_kv_heads, max_seq_len, head_dim].
    """

    def __init__(self, num_layers, num_slots, max_seq_len, num_kv_heads, head_dim, dtype=torch.float32, device=None):
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self.lengths = [0] * num_slots  # tokens cached per row (host side: the step's shapes depend on them)
        self.lo, self.hi = 0, 0
        self._cols_BS = None

    def select(self, lo: int, hi: int, num_tokens: int) -> None:
        """The next forward pass runs rows [lo, hi), each adding `num_tokens` tokens."""
        self.lo, self.hi = lo, hi
        start = torch.tensor(self.lengths[lo:hi], device=self.k.device)
        self._cols_BS = start[:, None] + torch.arange(num_tokens, device=self.k.device)

    def positions(self) -> torch.Tensor:
        """RoPE positions [B, S] of this step's tokens: each row continues from its own length."""
        return self._cols_BS

    def attention_mask(self) -> Optional[torch.Tensor]:
        """None (plain causal) when every row starts empty, else bool [B, 1, S, T]: each query sees its own row's
        keys up to its position (a longer row's extra columns are masked out)."""
        if max(self.lengths[self.lo:self.hi]) == 0:
            return None
        T = int(self._cols_BS[:, -1].max()) + 1
        k_pos = torch.arange(T, device=self.k.device)
        return (k_pos[None, None, :] <= self._cols_BS[:, :, None])[:, None]

    def update(self, layer_id: int, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor):
        rows = torch.arange(self.lo, self.hi, device=self.k.device)[:, None]
        self.k[layer_id, rows, :, self._cols_BS] = k_BKSD.transpose(1, 2)
        self.v[layer_id, rows, :, self._cols_BS] = v_BKSD.transpose(1, 2)
        T = max(self.lengths[self.lo:self.hi]) + k_BKSD.shape[2]
        return self.k[layer_id, self.lo:self.hi, :, :T], self.v[layer_id, self.lo:self.hi, :, :T]

    def advance(self, num_tokens: int) -> None:
        for row in range(self.lo, self.hi):
            self.lengths[row] += num_tokens

    def clear(self, row: int) -> None:
        """Free a row for a new sequence (its stale keys stay, masked out by the length)."""
        self.lengths[row] = 0

    def move(self, src: int, dst: int) -> None:
        """Row src's sequence becomes row dst's."""
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0
