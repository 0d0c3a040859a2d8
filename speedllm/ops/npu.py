"""Ascend NPU ops: torch_npu's fused kernels (the ones MindSpeed-LLM uses).

Imported only by `get_ops("npu")`, so the package imports on machines without torch_npu.
"""

import torch

from speedllm.errors import UserError

try:
    import torch_npu
except ImportError as err:
    raise UserError(
        f"hardware.ops=npu needs torch_npu ({err}); install the Ascend CANN toolkit and the torch_npu wheel "
        "matching your torch, or choose hardware.ops=reference"
    ) from err

from speedllm.ops.reference import cross_entropy, cross_entropy_grad_  # the fp32 loss is plain torch on every device
# the gated delta rule: the reference twin. torch_npu has no op for it that we could verify here (fla-core's npu
# extra needs triton-ascend and a pinned torch 2.10, not our torch)
from speedllm.ops.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule

__all__ = ["rms_norm", "rotary", "attention", "varlen_attention", "swiglu", "grouped_mm", "cross_entropy",
           "cross_entropy_grad_", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

# npu_fusion_attention's causal modes take a compressed 2048 x 2048 upper-triangular mask (True = masked).
_CAUSAL_MASK = {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]


def rotary(x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    return torch_npu.npu_rotary_mul(x_BSHD, cos_BSD.unsqueeze(2), sin_BSD.unsqueeze(2))


def _causal_mask(device):
    if device not in _CAUSAL_MASK:
        _CAUSAL_MASK[device] = torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)
    return _CAUSAL_MASK[device]


def attention(q, k, v, mask, scale):
    """npu_fusion_attention in BNSD layout; GQA is native (fewer kv heads than query heads)."""
    if mask is None and q.shape[2] == 1:
        atten_mask, sparse_mode = None, 0  # one query (decode) sees every key
    elif mask is None:
        atten_mask, sparse_mode = _causal_mask(q.device), 2  # 2: left-up causal, S == T
    else:
        atten_mask, sparse_mode = ~mask, 0  # 0: the full mask as given
    return torch_npu.npu_fusion_attention(
        q, k, v, q.shape[1], "BNSD", atten_mask=atten_mask, scale=scale, sparse_mode=sparse_mode
    )[0]


def varlen_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale):
    """npu_fusion_attention in TND layout: documents end at actual_seq_qlen/kvlen (cumulative, host ints);
    sparse_mode 3 is causal within each document (as MindSpeed-LLM's packed SFT)."""
    ends = cu_seqlens[1:].tolist()
    return torch_npu.npu_fusion_attention(
        q_THD, k_TKD, v_TKD, q_THD.shape[1], "TND", atten_mask=_causal_mask(q_THD.device), scale=scale,
        sparse_mode=3, actual_seq_qlen=ends, actual_seq_kvlen=ends,
    )[0]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch_npu.npu_swiglu(torch.cat((gate, up), dim=-1), dim=-1)


class _GroupedMatmul(torch.autograd.Function):
    """npu_grouped_matmul forward and backward (group_type 0 splits rows; 2 splits the reduction dim)."""

    @staticmethod
    def forward(ctx, x_ND, w_EOD, group_list):
        ctx.save_for_backward(x_ND, w_EOD, group_list)
        w_t = [w.t() for w in w_EOD.unbind(0)]
        return torch_npu.npu_grouped_matmul([x_ND], w_t, group_list=group_list, split_item=2, group_type=0)[0]

    @staticmethod
    def backward(ctx, grad_NO):
        x_ND, w_EOD, group_list = ctx.saved_tensors
        grad_x = torch_npu.npu_grouped_matmul(
            [grad_NO], list(w_EOD.unbind(0)), group_list=group_list, split_item=2, group_type=0
        )[0]
        grad_w = torch_npu.npu_grouped_matmul(
            [grad_NO.t()], [x_ND], group_list=group_list, split_item=3, group_type=2
        )[0]
        return grad_x, grad_w.view_as(w_EOD), None


def grouped_mm(x_ND: torch.Tensor, w_EOD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    return _GroupedMatmul.apply(x_ND, w_EOD, torch.cumsum(counts_E, dim=0))
