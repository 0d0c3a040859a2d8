"""CUDA ops: torch's fused kernels (SDPA flash/efficient attention, fused RMSNorm, grouped GEMM), and
flash-linear-attention's Triton kernels for the gated delta rule where that package is installed.

Everything else here is plain torch, so it also runs (and is tested) on CPU; on a GPU the same calls dispatch to
the fused kernels.
"""

import functools

import torch
import torch.nn.functional as F

from speedllm.ops import IGNORE_INDEX

# torch has no fused kernel for these; the eager form is it (the loss's gradient: in place, one log_softmax)
from speedllm.ops.reference import cross_entropy_grad_, rotary, swiglu
from speedllm.ops import gated_delta, reference

__all__ = ["rms_norm", "rotary", "attention", "varlen_attention", "swiglu", "grouped_mm", "cross_entropy",
           "cross_entropy_grad_", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's fused RMSNorm (one kernel forward and backward on CUDA). The weight takes the input's dtype: under
    autocast a bf16 input with an fp32 weight would not dispatch to the fused kernel."""
    return F.rms_norm(x, weight.shape, weight.to(x.dtype), eps)


def attention(q, k, v, mask, scale):
    """SDPA: flash attention for the causal case, memory-efficient attention with a mask."""
    if mask is None:  # one query (decode) sees every key: no causal mask (SDPA's is aligned top-left)
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def varlen_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale):
    """torch's flash-attention varlen kernel on CUDA (one launch for all documents); elsewhere the reference."""
    if not q_THD.is_cuda:
        return reference.varlen_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale)
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale,
                       window_size=(-1, 0), enable_gqa=True)


def grouped_mm(x_ND: torch.Tensor, w_EOD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """All experts in one grouped GEMM; offsets are the cumulative row counts (no host sync)."""
    offsets = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    return torch._grouped_mm(x_ND, w_EOD.transpose(-2, -1), offs=offsets)


def cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_NV.float(), labels_N, ignore_index=IGNORE_INDEX, reduction="sum")


@functools.cache
def _fla():
    """flash-linear-attention's gated delta rule module (the `fla` extra: fla-core), or None where not installed."""
    try:
        from fla.ops import gated_delta_rule
    except ImportError:
        return None
    return gated_delta_rule


def chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state=None, cu_seqlens=None):
    """fla's chunk_gated_delta_rule on a GPU where installed, else the reference twin. fla takes our layout
    ([B, S, heads, dim]) and our grouping of value heads (value head h reads key head h // (H / Hk)) as they are,
    normalizes q and k in its kernel, and returns its fp32 final states, one per document."""
    fla = _fla() if q_BSHK.is_cuda else None
    if fla is None:
        return gated_delta.chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state, cu_seqlens)
    return fla.chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state=initial_state,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())


def recurrent_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state):
    """fla's fused_recurrent_gated_delta_rule (one kernel per decode step) on a GPU where installed, else the
    reference twin."""
    fla = _fla() if q_BSHK.is_cuda else None
    if fla is None:
        return gated_delta.recurrent_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state)
    return fla.fused_recurrent_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g=g_BSH, beta=beta_BSH,
                                                initial_state=state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
