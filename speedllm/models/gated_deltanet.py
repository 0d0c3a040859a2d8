"""Gated DeltaNet, the linear-attention mixer of the hybrid Qwen family (Qwen3.5, Qwen3-Next), as transformers
computes it (Qwen3_5GatedDeltaNet / Qwen3NextGatedDeltaNet).

Letters: B batch, S sequence, D hidden, C conv channels (q, k and v), W conv kernel width, Hk key heads, H value
heads (each key head serves G = H / Hk consecutive ones), K key head dim, V value head dim.

The q, k, v channels (in_proj_qkv's rows and the conv's) are grouped by key head: [q, k, v of its G value heads]
per key head, the layout of Qwen3-Next's in_proj_qkvz, so a tensor-parallel rank's heads are one block of rows
(HF concatenates all q, then all k, then all v; speedllm.models.hf_adapter.qkv_channels maps the two orders).
Head counts come from the tensors' shapes, so the module runs on whatever heads its weights hold.

Per layer: input projections (HF's names), a causal depthwise conv over q, k, v then SiLU, beta = sigmoid(b), g =
-exp(A_log) * softplus(a + dt_bias), the gated delta rule (the op registry's chunked form for training and prefill,
its recurrent form for one-token decode), a gated RMSNorm per value head with z (fp32 as transformers), the output
projection. The conv, the gates and the rule run in `GatedDeltaRule`, which takes the per-head parameters (conv
weight, A_log, dt_bias) as arguments: a layout hands it this rank's shards of them (speedllm.parallel.tensor). A cache
keeps, per sequence, the last W - 1 conv inputs and the rule's state: neither grows with the sequence.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from speedllm.ops import Ops
from speedllm.ops.batch_invariant import elementwise


class GatedRMSNorm(nn.Module):
    """norm(o) * weight * silu(z) over each value head (weight from ones: not zero-centred), as transformers'
    Qwen3_5RMSNormGated: statistics and gate in fp32, the weight applied in o's dtype, one rounding at the end."""

    def __init__(self, dim: int, eps: float, ops: Ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (self.ops.rms_norm(o, self.weight, self.eps) * elementwise(F.silu, z.float())).to(o.dtype)


def causal_conv(x_BSC: torch.Tensor, weight_CW: torch.Tensor, past_BCW: Optional[torch.Tensor],
                document_ids: Optional[torch.Tensor]):
    """Depthwise causal conv then SiLU: (y_BSC, the last W - 1 inputs [B, C, W - 1] for a cache).

    Args:
        past_BCW: the W - 1 inputs before this step (a cache), or None (zeros: the sequence starts here).
        document_ids: [B, S] packed documents: a token's window never reaches into an earlier document; the past
            inputs belong to the first token's document (zeros where they do not).
    """
    B, S, C = x_BSC.shape
    W = weight_CW.shape[1]
    past = x_BSC.new_zeros(B, W - 1, C) if past_BCW is None else past_BCW.transpose(1, 2).to(x_BSC.dtype)
    padded = torch.cat([past, x_BSC], dim=1)  # [B, W - 1 + S, C]
    y = padded[:, W - 1:] * weight_CW[:, W - 1]
    for back in range(1, W):  # the tap `back` tokens before each token
        tap = padded[:, W - 1 - back:W - 1 - back + S] * weight_CW[:, W - 1 - back]
        if document_ids is not None:
            same = document_ids == document_ids[:, :1]  # taps into the past: the first document's tokens
            same[:, back:] = document_ids[:, back:] == document_ids[:, :-back]
            tap = tap * same[..., None]
        y = y + tap
    return elementwise(F.silu, y), padded[:, S:].transpose(1, 2)


class GatedDeltaRule(nn.Module):
    """The per-head part of Gated DeltaNet: conv + SiLU, gates, the gated delta rule; no parameters of its own
    (the mixer's conv weight, A_log and dt_bias come as arguments)."""

    def __init__(self, layer_id: int, k_dim: int, v_dim: int, group: int, ops: Ops):
        super().__init__()
        self.layer_id, self.k_dim, self.v_dim, self.group, self.ops = layer_id, k_dim, v_dim, group, ops

    def forward(self, qkv_BSC, b_BSH, a_BSH, conv_weight, A_log, dt_bias, kv_cache, document_ids, cu_seqlens):
        """o [B, S, H, V] of the heads the inputs hold (q, k, v grouped by key head, the module docstring)."""
        B, S, _ = qkv_BSC.shape
        conv_past, state = (None, None) if kv_cache is None else kv_cache.linear_state(self.layer_id)
        qkv, conv_tail = causal_conv(qkv_BSC, conv_weight.squeeze(1), conv_past, document_ids)
        q, k, v = qkv.view(B, S, -1, 2 * self.k_dim + self.group * self.v_dim).split(
            [self.k_dim, self.k_dim, self.group * self.v_dim], dim=-1)
        # v's value heads do not merge into one dim of the grouped layout: it is copied, and q and k too, so the conv's
        # output is not kept for backward beside the copy (as many saved bytes as the three views of it would be)
        q, k, v = q.contiguous(), k.contiguous(), v.reshape(B, S, -1, self.v_dim)
        beta = elementwise(torch.sigmoid, b_BSH)
        g = -A_log.float().exp() * elementwise(F.softplus, a_BSH.float() + dt_bias)
        if state is not None and S == 1:
            o, state = self.ops.recurrent_gated_delta_rule(q, k, v, g, beta, state)
        elif cu_seqlens is not None:  # packed rows back to back: one sequence of documents
            flat = [t.reshape(1, B * S, *t.shape[2:]) for t in (q, k, v, g, beta)]
            starts_BS = torch.ones_like(document_ids, dtype=torch.bool)
            starts_BS[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
            ends = starts_BS.sum(1).cumsum(0)  # a row's documents end before its number here
            initial = None
            if state is not None:  # a cache's state continues each row's first document
                initial = state.new_zeros(len(cu_seqlens) - 1, *state.shape[1:])
                initial = initial.index_copy(0, ends - starts_BS.sum(1), state)
            o, state = self.ops.chunk_gated_delta_rule(*flat, initial, cu_seqlens)
            o, state = o.view(B, S, *o.shape[2:]), state[ends - 1]
        else:
            o, state = self.ops.chunk_gated_delta_rule(q, k, v, g, beta, state, None)
        if kv_cache is not None:
            kv_cache.set_linear_state(self.layer_id, conv_tail, state)
        return o


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer; parameter names as transformers' (linear_attn.*)."""

    def __init__(self, cfg, layer_id: int, ops: Ops):
        super().__init__()
        self.layer_id = layer_id
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.group = self.num_v_heads // self.num_k_heads
        dim, key_dim, value_dim = cfg.hidden_size, self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.fused = cfg.linear_fused_projections
        if self.fused:  # Qwen3-Next: per key head [q, k, v of its value heads, z of them] and [b, a]
            self.in_proj_qkvz = nn.Linear(dim, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(dim, 2 * self.num_v_heads, bias=False)
        else:  # Qwen3.5 (q, k, v grouped by key head: the module docstring)
            self.in_proj_qkv = nn.Linear(dim, 2 * key_dim + value_dim, bias=False)
            self.in_proj_z = nn.Linear(dim, value_dim, bias=False)
            self.in_proj_b = nn.Linear(dim, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(dim, self.num_v_heads, bias=False)
        channels = 2 * key_dim + value_dim
        self.conv1d = nn.Conv1d(channels, channels, cfg.linear_conv_kernel_dim, groups=channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.rule = GatedDeltaRule(layer_id, self.k_dim, self.v_dim, self.group, ops)
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps, ops)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)

    def project(self, x_BSD: torch.Tensor):
        """(qkv_BSC grouped by key head, z_BSHV, b_BSH, a_BSH) from the input projections."""
        B, S, _ = x_BSD.shape
        if not self.fused:
            return (self.in_proj_qkv(x_BSD), self.in_proj_z(x_BSD).view(B, S, -1, self.v_dim),
                    self.in_proj_b(x_BSD), self.in_proj_a(x_BSD))
        qkv, z = self.in_proj_qkvz(x_BSD).view(B, S, -1, 2 * self.k_dim + 2 * self.group * self.v_dim).split(
            [2 * self.k_dim + self.group * self.v_dim, self.group * self.v_dim], dim=-1)
        b, a = self.in_proj_ba(x_BSD).view(B, S, -1, 2 * self.group).chunk(2, dim=-1)
        return qkv.reshape(B, S, -1), z.reshape(B, S, -1, self.v_dim), b.reshape(B, S, -1), a.reshape(B, S, -1)

    def forward(self, x_BSD, kv_cache=None, token_mask=None, document_ids=None, cu_seqlens=None):
        """Args:
            kv_cache: a KVCache / SlotCache holding this layer's conv and rule states for the rows running.
            token_mask: [B, S] 0 = padding; padding's inputs are zeroed (transformers'
                apply_mask_to_padding_states), so left padding leaves the states as if the sequence began after it.
            document_ids, cu_seqlens: packed documents (speedllm.models.qwen3.document_bounds): the conv and
                the rule restart at each document.
        """
        if token_mask is not None:
            x_BSD = x_BSD * token_mask[:, :, None].to(x_BSD.dtype)
        B, S, _ = x_BSD.shape
        qkv, z, b, a = self.project(x_BSD)
        o = self.rule(qkv, b, a, self.conv1d.weight, self.A_log, self.dt_bias, kv_cache, document_ids, cu_seqlens)
        return self.out_proj(self.norm(o, z).reshape(B, S, -1))
