"""int8 weight-only layers for CPUs: linear layers, and the (tied) embedding and output projection.

The quantization is torchao's (`Int8Tensor.from_hp`, per output row: w ~ q * scale, q in -128..127), so the
weights are the ones torchao's `Int8WeightOnlyConfig` makes. The matmul is `int8_wo_mm`: a small C kernel
(int8_kernel.c) compiled once with the host's compiler and cached, which reads one byte per weight and widens it
in registers, with AVX-512, AVX2+FMA, NEON and portable-C paths (speedllm.native picks one); torchao's CPU path and
torch's `_weight_int8pack_mm` were slower than fp32 at batch 1 here (BENCHMARKS.md). Without a compiler the
reference twin runs: F.linear on the widened weight.

quant=int8_dyn on CPUs (`Int8Linear(dynamic=True)`): the same int8 weights times the activations quantized per row
at each call (int8, scale max|x| / 127), the dot products in int32 on the CPU's integer instructions (`int8_dq_mm`:
AVX2 vpmaddubsw, AVX-VNNI / AVX512-VNNI vpdpbusd, or plain C; int8_dot_variant picks), scaled in fp32. The integers
are exact, so every variant equals the reference twin to the bit; the error against the float layer is the
activations' rounding (tests/test_cpu_isa.py states it).

Letters: N rows (tokens), D in features, O out features, V vocabulary.
"""

import ctypes
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from speedllm.native import c_function, cpu_features, isa

ARGTYPES = tuple([ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int])
DQ_ARGTYPES = tuple([ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int] * 2)
KERNEL_SOURCE = Path(__file__).with_name("int8_kernel.c")
INT8_DOTS = ("generic", "avx2", "avxvnni", "avx512vnni")  # int8_dq_mm's dot products (int8_kernel.c), by index
DOT_NEEDS = {"avx2": {"avx2"}, "avxvnni": {"avx2", "avx_vnni"}, "avx512vnni": {"avx512f", "avx512bw", "avx512_vnni"}}
PATH_DOTS = {"avx512": ("avx512vnni", "avxvnni", "avx2"), "avx2": ("avxvnni", "avx2")}  # best first, per path


def quantize_int8(weight_OD: torch.Tensor, block: int = 4096, group=None):
    """(q_OD int8, scale_O fp32) of a 2-D weight, by torchao's per-row symmetric rule (`block` rows at a time,
    so the temporaries stay small next to a vocabulary-sized table).

    group: the process group the weight's columns are split over (a row-parallel TP shard): each row's min and
    max are all-reduced over it first, so scales and int8 values are those of the whole rows, as without TP.
    """
    from torchao.quantization import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    q = torch.empty(weight_OD.shape, dtype=torch.int8, device=weight_OD.device)
    scale = torch.empty(weight_OD.shape[0], dtype=torch.float32, device=weight_OD.device)
    for start in range(0, weight_OD.shape[0], block):
        rows = weight_OD[start : start + block].detach().float()
        row_scale = None
        if group is not None:
            extremes = torch.stack([-rows.amin(1), rows.amax(1)])
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
            # torchao's scale of a row holding just the whole row's extremes is the whole row's scale
            row_scale = Int8Tensor.from_hp(torch.stack([-extremes[0], extremes[1]], 1), PerRow()).scale
        t = Int8Tensor.from_hp(rows, granularity=PerRow(), scale=row_scale)
        q[start : start + block], scale[start : start + block] = t.qdata, t.scale.reshape(-1)
    return q, scale


def kernel():
    """The compiled int8_wo_mm for the current kernel path (ctypes), or None where it cannot be built."""
    return c_function(KERNEL_SOURCE, "int8_wo_mm", ARGTYPES)


def int8_wo_mm_reference(x_ND: torch.Tensor, q_OD: torch.Tensor, scale_O: torch.Tensor) -> torch.Tensor:
    return F.linear(x_ND, q_OD.to(x_ND.dtype)) * scale_O.to(x_ND.dtype)


def int8_wo_mm(x_ND: torch.Tensor, q_OD: torch.Tensor, scale_O: torch.Tensor) -> torch.Tensor:
    """x_ND @ (q_OD * scale_O[:, None]).T in x's dtype (accumulated in fp32 by the kernel)."""
    fn = kernel() if x_ND.device.type == "cpu" and q_OD.shape[1] % 16 == 0 else None
    if fn is None or torch.is_grad_enabled() and x_ND.requires_grad:
        return int8_wo_mm_reference(x_ND, q_OD, scale_O)
    x = x_ND.float().contiguous()
    y = torch.empty(x.shape[0], q_OD.shape[0], dtype=torch.float32)
    fn(x.data_ptr(), q_OD.data_ptr(), scale_O.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], q_OD.shape[0],
       torch.get_num_threads())
    return y.to(x_ND.dtype)


def int8_dot_variant() -> str:
    """The dot product int8_dq_mm uses: the best of PATH_DOTS the CPU has within the kernel path (isa(), which
    SPEEDLLM_CPU_ISA forces), else generic."""
    features = set(cpu_features())
    return next((dot for dot in PATH_DOTS.get(isa(), ()) if DOT_NEEDS[dot] <= features), "generic")


def quantize_rows(x_ND: torch.Tensor):
    """(xq int8, xs fp32 [N]) of fp32 activations: per row xs = max|x| / 127, xq = round(x / xs) (half to even),
    a zero row all zeros, as int8_dq_mm does."""
    amax = x_ND.abs().amax(1)
    xs = amax / 127
    return torch.where(amax[:, None] > 0, torch.round(x_ND / xs[:, None]), 0).to(torch.int8), xs


def int8_dq_mm_reference(x_ND: torch.Tensor, q_OD: torch.Tensor, scale_O: torch.Tensor) -> torch.Tensor:
    xq, xs = quantize_rows(x_ND.float())
    acc = xq.double() @ q_OD.double().t()  # the int32 sums, exact
    return (acc.float() * xs[:, None] * scale_O).to(x_ND.dtype)


def int8_dq_mm(x_ND: torch.Tensor, q_OD: torch.Tensor, scale_O: torch.Tensor, dot: str = None) -> torch.Tensor:
    """x_ND @ (q_OD * scale_O[:, None]).T with x quantized per row to int8 (quantize_rows), in x's dtype; `dot`
    one of INT8_DOTS (default int8_dot_variant())."""
    fn = c_function(KERNEL_SOURCE, "int8_dq_mm", DQ_ARGTYPES) if x_ND.device.type == "cpu" else None
    if fn is None or torch.is_grad_enabled() and x_ND.requires_grad:
        return int8_dq_mm_reference(x_ND, q_OD, scale_O)
    x = x_ND.float().contiguous()
    y = torch.empty(x.shape[0], q_OD.shape[0], dtype=torch.float32)
    fn(x.data_ptr(), q_OD.data_ptr(), scale_O.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], q_OD.shape[0],
       INT8_DOTS.index(dot or int8_dot_variant()), torch.get_num_threads())
    return y.to(x_ND.dtype)


class _Int8Rows(nn.Module):
    """An int8 [rows, columns] matrix with one fp32 scale per row (inference only); `weight` dequantizes it, for
    code that reads the weight directly (the chunked loss of an output projection)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dtype = dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)

    @property
    def weight(self) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(self.dtype)


class Int8Linear(_Int8Rows):
    """A bias-free linear layer with an int8 weight and one fp32 scale per output row; dynamic: the activations
    quantized to int8 at each call too (int8_dq_mm, quant=int8_dyn), else kept in full precision (int8_wo_mm)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 dynamic: bool = False):
        super().__init__(qweight, scale, dtype)
        self.out_features, self.in_features = qweight.shape
        self.dynamic = dynamic

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, dynamic: bool = False) -> "Int8Linear":
        """group: for a row-parallel TP shard, the ranks holding the other columns of its rows (see quantize_int8)."""
        return cls(*quantize_int8(linear.weight, group=group), linear.weight.dtype, dynamic)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (int8_dq_mm if self.dynamic else int8_wo_mm)(x.reshape(-1, self.in_features), self.qweight, self.scale)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dynamic={self.dynamic}"


class Int8Embedding(_Int8Rows):
    """An embedding table in int8 with one scale per row; it can share its buffers with a tied Int8Linear."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        super().__init__(qweight, scale, dtype)
        self.num_embeddings, self.embedding_dim = qweight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scale[ids, None]).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"
