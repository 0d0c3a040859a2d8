"""Static caches for generation, one state per layer: keys/values for attention layers, conv inputs and the
gated delta rule's state for Gated DeltaNet layers (which do not grow with the sequence). Preallocated, GQA
layout; the write position is tracked here, and slots move and clear without the caller knowing layer kinds."""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class CacheShape:
    """What a cache holds per layer, from a model config (`cache_shape`).

    Args:
        attention_layers / linear_layers: ids of the softmax-attention / Gated DeltaNet layers.
        conv_channels, conv_len: a GDN layer's conv inputs kept (q, k, v channels; kernel width - 1).
        linear_heads, linear_key_dim, linear_value_dim: its rule state [heads, key dim, value dim] (fp32).
    """

    attention_layers: Tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    linear_layers: Tuple[int, ...] = ()
    conv_channels: int = 0
    conv_len: int = 0
    linear_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0


def layer_kinds(cfg) -> list:
    """Each layer's mixer: "full_attention" or "linear_attention" (an empty layer_types: all full attention)."""
    return list(cfg.layer_types) or ["full_attention"] * cfg.num_hidden_layers


def cache_shape(cfg, tp: int = 1) -> CacheShape:
    """The cache layout of model config `cfg`; under tensor parallelism a rank holds heads / tp of each kind."""
    kinds = layer_kinds(cfg)
    linear = tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention")
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return CacheShape(
        attention_layers=tuple(i for i, kind in enumerate(kinds) if kind != "linear_attention"),
        num_kv_heads=cfg.num_key_value_heads // tp, head_dim=cfg.head_dim, linear_layers=linear,
        conv_channels=(2 * key_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim) // tp,
        conv_len=cfg.linear_conv_kernel_dim - 1, linear_heads=cfg.linear_num_value_heads // tp,
        linear_key_dim=cfg.linear_key_head_dim, linear_value_dim=cfg.linear_value_head_dim)


def cache_bytes(cfg, rows: int, max_seq_len: int, itemsize: int, tp: int = 1) -> float:
    """Bytes of a cache for `rows` sequences of up to `max_seq_len` tokens in a dtype of `itemsize` bytes: K/V of
    the attention layers, which grow with the length, and the GDN layers' conv inputs and fp32 states, which do not."""
    shape = cache_shape(cfg, tp)
    kv = 2 * len(shape.attention_layers) * shape.num_kv_heads * max_seq_len * shape.head_dim * itemsize
    conv = len(shape.linear_layers) * shape.conv_channels * shape.conv_len * itemsize
    state = len(shape.linear_layers) * shape.linear_heads * shape.linear_key_dim * shape.linear_value_dim * 4
    return rows * (kv + conv + state)


class _States:
    """Keys/values [attention layers, rows, kv heads, max_seq_len, head_dim], and per GDN layer the conv inputs
    [rows, channels, conv_len] (activation dtype) and the rule state [rows, heads, key dim, value dim] (fp32)."""

    def __init__(self, shape: CacheShape, rows: int, max_seq_len: int, dtype, device):
        kv = (len(shape.attention_layers), rows, shape.num_kv_heads, max_seq_len, shape.head_dim)
        self.k = torch.zeros(kv, dtype=dtype, device=device)
        self.v = torch.zeros(kv, dtype=dtype, device=device)
        self.conv = torch.zeros(len(shape.linear_layers), rows, shape.conv_channels, shape.conv_len, dtype=dtype,
                                device=device)
        self.state = torch.zeros(len(shape.linear_layers), rows, shape.linear_heads, shape.linear_key_dim,
                                 shape.linear_value_dim, dtype=torch.float32, device=device)
        self.slot = {layer: i for i, layer in enumerate(shape.attention_layers)}
        self.slot.update({layer: i for i, layer in enumerate(shape.linear_layers)})
        self.max_seq_len = max_seq_len
        self.lo, self.hi = 0, rows  # the rows the next forward runs

    def linear_state(self, layer_id: int):
        """(conv inputs, rule state) of a GDN layer for the rows running."""
        i = self.slot[layer_id]
        return self.conv[i, self.lo:self.hi], self.state[i, self.lo:self.hi]

    def set_linear_state(self, layer_id: int, conv_BCW: torch.Tensor, state_BHKV: torch.Tensor) -> None:
        i = self.slot[layer_id]
        self.conv[i, self.lo:self.hi] = conv_BCW
        self.state[i, self.lo:self.hi] = state_BHKV


class KVCache(_States):
    """Every layer's state for `batch` sequences of up to `max_seq_len` tokens (`cache_shape` says which).

    The model writes a forward pass's keys/values at `pos` and advances `pos` after its last layer, so a
    prefill followed by one-token decode steps needs no bookkeeping by the caller. `key_mask` remembers which
    cached positions are real tokens (0 = left padding) so later steps keep ignoring the padding.
    """

    def __init__(self, shape: CacheShape, batch, max_seq_len, dtype=torch.float32, device=None):
        super().__init__(shape, batch, max_seq_len, dtype, device)
        self.key_mask = torch.ones(batch, max_seq_len, dtype=torch.bool, device=device)
        self.padded = False  # whether key_mask was ever written (else every cached position is a real token)
        self.pos = 0

    def update(self, layer_id: int, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor):
        """Store this step's keys/values at the write position; return all cached ones up to and including them."""
        i, end = self.slot[layer_id], self.pos + k_BKSD.shape[2]
        self.k[i, :, :, self.pos : end] = k_BKSD
        self.v[i, :, :, self.pos : end] = v_BKSD
        return self.k[i, :, :, :end], self.v[i, :, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.pos += num_tokens


class SlotCache(_States):
    """Continuous batching: `num_slots` rows, each row one sequence at its own length.

    A forward pass runs on rows [0, num_rows) (`select`), every row adding the same number of tokens S at
    its own length; requests join by a prefill into a free row and leave between steps (`move` keeps the
    running rows contiguous, so a step reads a view of the cache, never a gathered copy).
    """

    def __init__(self, shape: CacheShape, num_slots, max_seq_len, dtype=torch.float32, device=None):
        super().__init__(shape, num_slots, max_seq_len, dtype, device)
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
        i = self.slot[layer_id]
        rows = torch.arange(self.lo, self.hi, device=self.k.device)[:, None]
        self.k[i, rows, :, self._cols_BS] = k_BKSD.transpose(1, 2)
        self.v[i, rows, :, self._cols_BS] = v_BKSD.transpose(1, 2)
        T = max(self.lengths[self.lo:self.hi]) + k_BKSD.shape[2]
        return self.k[i, self.lo:self.hi, :, :T], self.v[i, self.lo:self.hi, :, :T]

    def advance(self, num_tokens: int) -> None:
        for row in range(self.lo, self.hi):
            self.lengths[row] += num_tokens

    def clear(self, row: int) -> None:
        """Free a row for a new sequence (its stale keys stay, masked out by the length; GDN states restart)."""
        self.lengths[row] = 0
        self.conv[:, row] = 0
        self.state[:, row] = 0

    def move(self, src: int, dst: int) -> None:
        """Row src's sequence becomes row dst's."""
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.conv[:, dst] = self.conv[:, src]
        self.state[:, dst] = self.state[:, src]
        self.lengths[dst], self.lengths[src] = n, 0
