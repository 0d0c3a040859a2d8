"""int4 weight-only linear layers for CPUs: torchao's int4 numbers, our C kernel (int4_kernel.c).

Why not torchao here: torchao 0.18's Int4WeightOnlyConfig needs the `mslk` kernels, which exist for CUDA only;
its CPU layout was removed. The quantization itself is torchao's (`get_groupwise_affine_qparams`, the
"tinygemm" scheme: per group of `group_size` input features w ~ (q - 8) * scale + zero, q in 0..15), the same
one its QAT fake quantizer applies during `quant=qat_int4` training, so a QAT checkpoint meets exactly the
numbers it was trained against (scales and zeros are kept in fp32, activations stay fp32).

Why our own kernel: torch's packed int4 CPU matmul (`_weight_int4pack_mm_for_cpu`, bf16 activations) was only
x0.9-1.6 of an fp32 matmul at qwen3_0.6b's decode sizes on an AVX2 CPU (benchmarks/bench_quant.py,
docs/benchmarks/cpu-kernels.md); int4_kernel.c reads half a byte per weight and widens the nibbles in
registers, with AVX-512, AVX2, NEON and portable-C paths (speedllm.native picks one). Without a compiler the reference
twin runs: F.linear on the dequantized weight.

Letters: N rows (tokens), D in features, O out features, G groups (D / group_size), U units of 32 features.
"""

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from speedllm.native import c_function

ARGTYPES = tuple([ctypes.c_void_p] * 5 + [ctypes.c_long] * 4 + [ctypes.c_int])
KERNEL_SOURCE = Path(__file__).with_name("int4_kernel.c")
UNIT = 32  # input features per 16 packed bytes (int4_kernel.c)


def quantize_int4(weight_OD: torch.Tensor, group_size: int):
    """(q_OD int32 in 0..15, scales_OG, zeros_OG) of a 2-D weight, by torchao's groupwise affine rule."""
    from torchao.quantization.utils import get_groupwise_affine_qparams, groupwise_affine_quantize_tensor_from_qparams

    scales, zeros = get_groupwise_affine_qparams(weight_OD.float(), 4, group_size, dtype=torch.float32)
    q = groupwise_affine_quantize_tensor_from_qparams(weight_OD.float(), scales, zeros, 4, group_size)
    return q.to(torch.int32), scales, zeros


def pack_int4(q_OD: torch.Tensor) -> torch.Tensor:
    """q in 0..15 [O, D] as the kernel's bytes [O, D / 2]: per unit u of 32 features, 8 little-endian uint16 lanes,
    lane i holding q[32u + 8k + i] in bits 4k..4k+3 (int4_kernel.c)."""
    O, D = q_OD.shape
    q_OUKI = q_OD.to(torch.int32).reshape(O, D // UNIT, 4, 8)
    lanes_OUI = q_OUKI[:, :, 0] | q_OUKI[:, :, 1] << 4 | q_OUKI[:, :, 2] << 8 | q_OUKI[:, :, 3] << 12
    return torch.stack([lanes_OUI & 0xFF, lanes_OUI >> 8], -1).to(torch.uint8).reshape(O, D // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The q [O, D] (int32, 0..15) that pack_int4 packed."""
    O, D = packed.shape[0], packed.shape[1] * 2
    bytes_OUI2 = packed.to(torch.int32).reshape(O, D // UNIT, 8, 2)
    lanes_OUI = bytes_OUI2[..., 0] | bytes_OUI2[..., 1] << 8
    return torch.stack([lanes_OUI >> 4 * k & 0xF for k in range(4)], 2).reshape(O, D)


def kernel():
    """The compiled int4_wo_mm for the current kernel path (ctypes), or None where it cannot be built."""
    return c_function(KERNEL_SOURCE, "int4_wo_mm", ARGTYPES)


def int4_wo_mm_reference(x_ND, packed, scales_OG, zeros_OG, group_size: int) -> torch.Tensor:
    from torchao.quantization.utils import groupwise_affine_dequantize_tensor_from_qparams

    w_OD = groupwise_affine_dequantize_tensor_from_qparams(unpack_int4(packed), scales_OG, zeros_OG, 4, group_size)
    return F.linear(x_ND, w_OD.to(x_ND.dtype))


def int4_wo_mm(x_ND, packed, scales_OG, zeros_OG, group_size: int) -> torch.Tensor:
    """x_ND @ w.T in x's dtype for the int4 weight w (packed, scales, zeros), accumulated in fp32 by the kernel."""
    fn = kernel() if x_ND.device.type == "cpu" else None
    if fn is None or torch.is_grad_enabled() and x_ND.requires_grad:
        return int4_wo_mm_reference(x_ND, packed, scales_OG, zeros_OG, group_size)
    x = x_ND.float().contiguous()
    y = torch.empty(x.shape[0], packed.shape[0], dtype=torch.float32)
    fn(x.data_ptr(), packed.data_ptr(), scales_OG.data_ptr(), zeros_OG.data_ptr(), y.data_ptr(), x.shape[0],
       x.shape[1], packed.shape[0], group_size, torch.get_num_threads())
    return y.to(x_ND.dtype)


class Int4Linear(nn.Module):
    """A bias-free linear layer whose weight is int4 (packed for int4_kernel.c, fp32 scales and zeros per group).

    Built from a full-precision nn.Linear with `Int4Linear.from_linear`; the weight is not a parameter any more
    (inference only). Outputs come back in the dtype of the input.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, packed, scales, zeros):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> "Int4Linear":
        q, scales, zeros = quantize_int4(linear.weight.detach(), group_size)
        return cls(linear.in_features, linear.out_features, group_size, pack_int4(q), scales.contiguous(),
                   zeros.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int4_wo_mm(x.reshape(-1, self.in_features), self.packed, self.scales, self.zeros, self.group_size)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"
