"""Reference ops: plain torch, written as the math reads; the ground truth every other set is tested against.

`attention` calls torch's scaled_dot_product_attention, whose definition is the formula in `attention_math`:
on CPU it is several times faster and lighter than the spelled-out version (it never keeps the [S, T] score
matrix for backward), and it is a plain torch op, so the CPU path stays fast. `attention_math` stays here
as the written-out formula the tests hold `attention` against.
"""

import torch
import torch.nn.functional as F

from speedllm.ops import IGNORE_INDEX
from speedllm.ops.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: F401 (the op set)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, statistics in fp32, the product in the input dtype (as transformers' Qwen3RMSNorm)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x (one head dim per head); cos/sin are broadcast over the heads. In x's dtype: under autocast
    (a bf16 x, fp32 cos/sin) computed in fp32 and rounded once, as attention takes it in bf16 anyway."""
    cos, sin = cos_BSD.unsqueeze(2), sin_BSD.unsqueeze(2)
    return (x_BSHD * cos + rotate_half(x_BSHD) * sin).to(x_BSHD.dtype)


def attention(q, k, v, mask, scale):
    """Causal (mask None) or masked GQA attention through SDPA; see the module docstring."""
    if mask is None:  # SDPA's causal mask is aligned top-left: one query (decode) sees every key without it
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def varlen_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale):
    """Causal attention within each document, as one SDPA call over the documents padded to max_seqlen.

    A document's padding sits after its last token, so causality alone hides it from the real queries; the
    padding's own outputs are dropped (and get no gradient). Cost: docs x max_seqlen^2 instead of T^2.
    """
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    offsets = torch.arange(max_seqlen, device=q_THD.device)
    valid = offsets[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0)  # [docs, max_seqlen] token index
    q, k, v = (x[index].transpose(1, 2) for x in (q_THD, k_TKD, v_TKD))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)[valid]


def attention_math(q, k, v, mask, scale):
    """softmax(q k^T * scale + mask) v with kv heads repeated for GQA, softmax in fp32."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is None:
        S, T = q.shape[2], k.shape[2]
        mask = torch.ones(S, T, dtype=torch.bool, device=q.device).tril(T - S)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def grouped_mm(x_ND: torch.Tensor, w_EOD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """One matmul per expert over its contiguous block of rows."""
    blocks = torch.split(x_ND, counts_E.tolist())
    return torch.cat([block @ w_EOD[e].t() for e, block in enumerate(blocks)])


def cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """Sum of -log softmax(logits)[label] over rows whose label is not IGNORE_INDEX, in fp32."""
    logits = logits_NV.float()
    keep = labels_N != IGNORE_INDEX
    picked = logits.gather(1, labels_N.clamp(min=0).unsqueeze(1)).squeeze(1)
    return ((torch.logsumexp(logits, dim=-1) - picked) * keep).sum()


def cross_entropy_grad_(logits_NV: torch.Tensor, labels_N: torch.Tensor):
    """Summed cross-entropy of the logits and d(sum)/d(logits), computed in the logits' own storage: fp32 ones
    in place; others (bf16 under autocast) widened to fp32, the gradient rounded back into their storage.

    The loss is log-softmax + NLL, as torch's cross_entropy computes it. torch's CPU and CUDA log-softmax
    kernels read each element before writing the same element, so they run in place (one pass instead of
    max / subtract / exp / sum / divide); exp_ then turns the log-probabilities into the softmax. Other
    devices (torch_npu) make no such promise and get a copy.
    """
    if logits_NV.dtype != torch.float32:
        loss, grad = cross_entropy_grad_(logits_NV.float(), labels_N)
        return loss, logits_NV.copy_(grad)
    keep = (labels_N != IGNORE_INDEX).unsqueeze(1)
    targets = labels_N.clamp(min=0).unsqueeze(1)
    if logits_NV.device.type in ("cpu", "cuda"):
        logprobs = torch.log_softmax(logits_NV, dim=1, out=logits_NV)
    else:
        logprobs = logits_NV.copy_(torch.log_softmax(logits_NV, dim=1))
    loss = -(logprobs.gather(1, targets) * keep).sum()
    probs = logprobs.exp_()
    probs.scatter_add_(1, targets, torch.full(targets.shape, -1.0, device=probs.device))
    return loss, zero_unlabeled_(probs, keep.squeeze(1))


def zero_unlabeled_(grad_NV: torch.Tensor, keep_N: torch.Tensor) -> torch.Tensor:
    """grad_NV with the rows of tokens without a label (keep_N False) zeroed in place: on CPU those rows only, not
    a pass over every logit; on an accelerator a mask multiply (no host sync for the row indices)."""
    if grad_NV.device.type == "cpu":
        return grad_NV.index_fill_(0, torch.nonzero(~keep_N).squeeze(1), 0.0)
    return grad_NV.mul_(keep_N[:, None])
