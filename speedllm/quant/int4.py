"""int4 weight-only linear layers on torch's packed CPU matmul (`torch._weight_int4pack_mm_for_cpu`).

Why not torchao here: torchao 0.18's Int4WeightOnlyConfig needs the `mslk` kernels, which exist for CUDA only;
its CPU layout was removed. The quantization itself is torchao's (`get_groupwise_affine_qparams`, the
"tinygemm" scheme: per group of `group_size` input features w ~ (q - 8) * scale + zero, q in 0..15), the same
one its QAT fake quantizer applies during `quant=qat_int4` training, so a QAT checkpoint meets exactly the
numbers it was trained against.

Letters: N rows (tokens), D in features, O out features, G groups (D / group_size).
"""

import torch
from torch import nn
from torchao.quantization.utils import (
    get_groupwise_affine_qparams,
    groupwise_affine_quantize_tensor_from_qparams,
    pack_tinygemm_scales_and_zeros,
)

# The packed kernel is several times faster with bf16 activations than with fp32 ones on AVX-512 CPUs
# (benchmarks/bench_quant.py); the weight is already 4-bit, so a bf16 activation adds little error.
CPU_COMPUTE_DTYPE = torch.bfloat16


def quantize_int4(weight_OD: torch.Tensor, group_size: int):
    """(q_OD int32 in 0..15, scales_OG, zeros_OG) of a 2-D weight, by torchao's groupwise affine rule."""
    scales, zeros = get_groupwise_affine_qparams(weight_OD.float(), 4, group_size, dtype=torch.float32)
    q = groupwise_affine_quantize_tensor_from_qparams(weight_OD.float(), scales, zeros, 4, group_size)
    return q.to(torch.int32), scales, zeros


class Int4Linear(nn.Module):
    """A bias-free linear layer whose weight is int4, packed for the CPU kernel.

    Built from a full-precision nn.Linear with `Int4Linear.from_linear`; the weight is not a parameter any more
    (inference only). Outputs come back in the dtype of the input.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, packed, scales_zeros):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> "Int4Linear":
        q, scales, zeros = quantize_int4(linear.weight.detach(), group_size)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        scales_zeros = pack_tinygemm_scales_and_zeros(scales, zeros, torch.float32).to(CPU_COMPUTE_DTYPE)
        return cls(linear.in_features, linear.out_features, group_size, packed, scales_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_ND = x.reshape(-1, self.in_features).to(CPU_COMPUTE_DTYPE)
        y_NO = torch._weight_int4pack_mm_for_cpu(x_ND, self.packed, self.group_size, self.scales_zeros)
        return y_NO.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
