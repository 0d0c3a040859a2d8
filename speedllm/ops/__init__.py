"""Op registry: one signature per op, one implementation set per device family.

The hardware profile's `ops` key (reference | cpu | cuda | npu) picks the set; model code only calls `ops.<name>(...)`,
so a device gets its fused kernels without a fork of the model.

Signatures (letters: B batch, S query length, T key length, H query heads, K kv heads, Dh head_dim,
N rows, D features, O output features, E experts, V vocabulary):
  rms_norm(x_ND, weight_D, eps) -> y_ND                    RMSNorm over the last dim, statistics in fp32
  rotary(x_BSHD, cos_BSD, sin_BSD) -> x_BSHD                RoPE, rotate-half convention (as transformers), in x's
                                                           dtype (fp32 cos/sin under bf16 autocast)
  attention(q_BHSD, k_BKTD, v_BKTD, mask, scale) -> o_BHSD  GQA; mask None = causal, the queries being the last
                                                           S of the T keys (S == T, or S == 1: every key),
                                                           otherwise a bool [B, 1, S, T] tensor, True = may
                                                           attend
  varlen_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale) -> o_THD
                                                           causal GQA within each of the documents packed
                                                           back to back along T; cu_seqlens int32 [docs + 1]
                                                           (0, end of doc 0, ..., T), max_seqlen the longest
  swiglu(gate, up) -> silu(gate) * up
  grouped_mm(x_ND, w_EOD, counts_E) -> y_NO                 rows of x grouped by expert in order; group e uses w[e]
  cross_entropy(logits_NV, labels_N) -> fp32 scalar         SUM over labels != IGNORE_INDEX
  cross_entropy_grad_(logits_NV, labels_N) -> (fp32 scalar, grad_NV)
                                                           that sum and its gradient softmax - one_hot (zero
                                                           rows where ignored), written over the logits (fp32 or
                                                           bf16: the training loss's chunks, speedllm.ops.loss)
  chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state, cu_seqlens) -> (o_BSHV, state_NHKV)
  recurrent_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state_BHKV) -> (o_BSHV, state_BHKV)
                                                           Gated DeltaNet's rule, chunked (training, prefill;
                                                           packed documents by cu_seqlens) and token by token
                                                           (decode); q, k normalized inside; fp32 states
                                                           (speedllm.ops.gated_delta, the reference twin)
"""

import importlib
from dataclasses import dataclass
from typing import Callable


IMPLEMENTATIONS = ("reference", "cpu", "cuda", "npu")
IGNORE_INDEX = -100  # a label that takes no loss (padding, prompt tokens); the value transformers uses


@dataclass(frozen=True)
class Ops:
    """One implementation of every op (plain functions, so a model holding it can be deep-copied)."""

    name: str
    rms_norm: Callable
    rotary: Callable
    attention: Callable
    varlen_attention: Callable
    swiglu: Callable
    grouped_mm: Callable
    cross_entropy: Callable
    cross_entropy_grad_: Callable
    chunk_gated_delta_rule: Callable
    recurrent_gated_delta_rule: Callable


_CACHE = {}


def get_ops(name: str) -> Ops:
    """Return the op set `name` (reference | cpu | cuda | npu, validated as hardware.ops); the npu set imports torch_npu
    only here."""
    if name not in _CACHE:
        module = importlib.import_module(f"speedllm.ops.{name}")
        _CACHE[name] = Ops(
            name=name,
            rms_norm=module.rms_norm,
            rotary=module.rotary,
            attention=module.attention,
            varlen_attention=module.varlen_attention,
            swiglu=module.swiglu,
            grouped_mm=module.grouped_mm,
            cross_entropy=module.cross_entropy,
            cross_entropy_grad_=module.cross_entropy_grad_,
            chunk_gated_delta_rule=module.chunk_gated_delta_rule,
            recurrent_gated_delta_rule=module.recurrent_gated_delta_rule,
        )
    return _CACHE[name]
