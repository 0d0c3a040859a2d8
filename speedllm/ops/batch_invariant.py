"""Batch-invariant mode on CPUs (hardware.batch_invariant): every matmul and attention of the model sums each
output element in one fixed order (batch_invariant.c), so a token's values do not depend on how many rows or keys
came with it. A rollout's decode step (a few rows, a cache of past keys) then computes the same bits as the
training forward over the whole sequences, and rl/logprob_diff is exactly 0.

`mode(True)` routes torch's CPU `mm`, `addmm` and `bmm` (what linear layers, the output layer and the MoE experts call,
forward and backward, also inside DTensor and autocast) to the fixed-order kernel for the run, and `attention` is
the op set's attention while the mode is on: its forward is the fixed-order kernel, its backward the reference's
(gradients need no invariance). The norms, rotary, SwiGLU and log-softmax already compute each row on its own;
the hybrid models' sigmoid / SiLU / softplus / exp gates go through `elementwise`, and their gated delta rule
runs token by token (speedllm.ops.cpu.chunk_gated_delta_rule).
Other dtypes than fp32 and bf16 are products summed by torch.sum (rare: nothing of the model's).

On the avx512 path the matmuls run on packed operands (a row's k broadcast against a tile of 16 columns): fp32 on
FMA lanes (`bi_fma_mm`), bf16 on AMX tiles where the CPU has AMX (`bi_amx_mm`, tdpbf16ps), else on vdpbf16ps lanes
where it has AVX512-BF16 (`bi_dp_mm`); elsewhere on the dot products' lanes (`bi_mm`, `bi_mm_bf16`). Each path has
its own fixed order, so a machine's bits are its path's. Setting SPEEDLLM_CPU_ISA (any path) leaves AMX out, which
is how its twins are tested on an AMX machine.

The packed bf16 kernel also takes fp32 operands, rounded to bf16 as it packs them, and writes fp32 results
(`mixed_bmm`): the MoE experts run on it under bf16 autocast in and out of the mode (speedllm.ops.cpu._GroupedMM).
"""

import contextlib
import ctypes
import functools
import os
import warnings
from pathlib import Path

import torch

from speedllm.native import ISA_ENV, c_function, cpu_features, isa, load

SOURCE = Path(__file__).with_name("batch_invariant.c")
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_MM = (_P, _P, _P, _L, _L, _L, _L, _I)
_ATTENTION = (_P,) * 5 + (_L,) * 6 + (ctypes.c_float, _I)
_PACKED_MM = (_P, _L, _L, _L) * 3 + (_L, _L, _L, _L, _I, _L, _L, _L)
_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}
_active = False


def _kernel(name: str, dtype: torch.dtype, argtypes: tuple):
    return c_function(SOURCE, name + _SUFFIX[dtype], argtypes)


def available() -> bool:
    """Whether the kernels can be built here (a C compiler)."""
    return _kernel("bi_mm", torch.float32, _MM) is not None


def amx_missing() -> str:
    """Why the bf16 matmuls do not run on AMX tiles here ("" where they do), for task=doctor."""
    if os.environ.get(ISA_ENV):
        return f"{ISA_ENV} is set"
    if "amx_bf16" not in cpu_features():
        return "this CPU has no AMX-BF16"
    return _amx_grant(isa())


@functools.cache
def _amx_grant(path: str) -> str:
    library = load(SOURCE, path)
    if library is None:
        return "the kernels are not built"
    if not hasattr(library, "bi_amx_ready"):
        return "the compiler did not build the AMX kernel for this CPU"
    if not library.bi_amx_ready():  # asks Linux for the tile state, once per process
        return "Linux did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM refused)"
    return ""


def _packed_kernel(dtype=torch.bfloat16) -> str:
    """The packed matmul of `dtype` here (the avx512 path): fp32 bi_fma_mm; bf16 bi_amx_mm (AMX tiles), else
    bi_dp_mm (AVX512-BF16); "" where there is none (bi_mm's and bi_mm_bf16's lanes run)."""
    if dtype == torch.bfloat16 and not amx_missing():
        return "bi_amx_mm"
    name = {torch.float32: "bi_fma_mm", torch.bfloat16: "bi_dp_mm"}.get(dtype)
    return name if name and _built(isa(), name) else ""


@functools.cache
def _built(path: str, name: str) -> bool:
    library = load(SOURCE, path)
    return library is not None and hasattr(library, name)


def bf16_path() -> str:
    """The bf16 matmul of the mode on this machine, for task=doctor."""
    if not available():
        return "torch.sum of products (no C compiler: kernels not built)"
    kernel = _packed_kernel()
    if kernel == "bi_amx_mm":
        return "AMX tiles (tdpbf16ps)"
    return f"{'AVX512-BF16 (vdpbf16ps)' if kernel else 'fp32 lanes'}; not AMX: {amx_missing()}"


def active() -> bool:
    return _active


def _threads(work: int) -> int:
    """torch's thread count, or one thread for a small call (waking the OpenMP team costs more than the work)."""
    return torch.get_num_threads() if work >= 1 << 18 else 1


def _supported(*tensors) -> bool:
    dtype = tensors[0].dtype
    return dtype in _SUFFIX and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N], each element summed over K in the kernel's fixed order."""
    return bmm(a[None], b[None])[0]


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] in one kernel call, each entry as `mm` computes it."""
    if not _supported(a, b):
        return (a[..., None] * b[:, None]).sum(2)  # no matmul: the mode replaces them
    (B, M, K), N = a.shape, b.shape[2]
    kernel = B and M and N and K and _packed_kernel(a.dtype)
    if kernel:
        y = torch.empty(B, M, N, dtype=a.dtype)
        _packed_mm(kernel, a, b, y, _threads(M * N * K))
        return y
    x, w = a.contiguous(), b.transpose(1, 2).contiguous()  # w [B, N, K]: a linear weight's own layout, no copy
    y = torch.empty(B, M, N, dtype=a.dtype)
    if B and M and N:
        if K == 0:
            return y.zero_()
        _kernel("bi_mm", a.dtype, _MM)(x.data_ptr(), w.data_ptr(), y.data_ptr(), B, M, N, K, _threads(B * M * N * K))
    return y


def _packed_mm(kernel: str, a: torch.Tensor, b: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    """y [B, M, N] (contiguous) = a [B, M, K] @ b [B, K, N] by packed `kernel`, a and b in any strides, of its dtype
    or (a bf16 kernel) fp32, rounded to bf16 as they are packed, y of its dtype or fp32. The kernel computes P Q^T
    for P [R, K], Q [C, K]: P = a and Q = b^T, or P = b^T and Q = a with y written transposed, the same bits either
    way (a product is the same either way round): the one with the least copying, P read in place where it can be
    (rows contiguous of the kernel's dtype, K a multiple of 32)."""
    (B, M, K), N = a.shape, b.shape[2]
    bt = b.transpose(1, 2)
    size = 4 if kernel == "bi_fma_mm" else 2

    def p_cost(t):  # elements copied (a transposing copy counted 4x) to use t as P
        in_place = t.stride(2) == 1 and K % 32 == 0 and t.element_size() == size
        return 0 if in_place else t.numel() * (1 if t.stride(2) == 1 else 4)

    swap = p_cost(bt) + a.numel() + 2 * B * M * N < p_cost(a) + bt.numel()
    (p, q), (ysr, ysc) = ((bt, a), (1, N)) if swap else ((a, bt), (N, 1))
    c_function(SOURCE, kernel, _PACKED_MM)(p.data_ptr(), *p.stride(), q.data_ptr(), *q.stride(), y.data_ptr(),
                                           M * N, ysr, ysc, B, p.shape[1], q.shape[1], K, threads,
                                           p.element_size(), q.element_size(), y.element_size())


def mixed_available() -> bool:
    """Whether this CPU has the packed bf16 kernel `mixed_bmm` runs on (AMX, AVX512-BF16)."""
    return available() and bool(_packed_kernel(torch.bfloat16))


def mixed_bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out [B, M, N] (contiguous) = a [B, M, K] @ b [B, K, N] in bf16 products on the packed bf16 kernel (where
    mixed_available()), whichever of a, b and out are fp32 or bf16: an fp32 operand is rounded to bf16 as it is
    packed (the cast fused into the packing), an fp32 out holds the fp32 sums unrounded. Each element sums over K
    in the kernel's fixed order, as `bmm`'s bf16 path does."""
    if out.numel() and a.shape[2] == 0:
        out.zero_()
    elif out.numel():
        _packed_mm(_packed_kernel(torch.bfloat16), a, b, out, _threads(out.numel() * a.shape[2]))


def _mm_out(a, b, *, out):
    return out.copy_(mm(a, b))


def _addmm(bias, a, b, *, beta=1, alpha=1):
    product = mm(a, b)
    if alpha != 1:
        product = product * alpha
    return product if beta == 0 else product + (bias if beta == 1 else bias * beta)


class _Attention(torch.autograd.Function):
    """The fixed-order attention forward; the reference math's backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.scale = mask, scale
        (B, H, S, D), (KV, T) = q.shape, k.shape[1:3]
        allowed = None if mask is None else mask.expand(B, 1, S, T).reshape(B, S, T).to(torch.uint8).contiguous()
        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty_like(qc)
        _kernel("bi_attention", q.dtype, _ATTENTION)(
            qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), None if allowed is None else allowed.data_ptr(),
            out.data_ptr(), B, H, KV, S, T, D, scale, _threads(B * H * S * T * D))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from speedllm.ops.reference import attention_math

        q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = attention_math(q, k, v, ctx.mask, ctx.scale)
            wanted = [t for t in (q, k, v) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad_out))
        return (*(next(grads) if t.requires_grad else None for t in (q, k, v)), None, None)


def attention(q, k, v, mask, scale):
    """The op set's attention signature (speedllm.ops): mask None is causal, the queries being the last S of the
    T keys; a bool mask [B, 1, S, T] says which keys each query may attend to."""
    if not _supported(q, k, v) or any(type(t) is not torch.Tensor for t in (q, k, v)):
        from speedllm.ops.reference import attention as reference

        return reference(q, k, v, mask, scale)
    return _Attention.apply(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else float(scale))


def elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn (sigmoid, SiLU, softplus, exp); in the mode, every element by torch's scalar
    formula. torch's vectorized loop computes the elements past the last full vector with the scalar formula, and a
    transcendental's two formulas can differ in the last bit, so an element's value would depend on how many came
    before it in the tensor (e.g. the rows of its batch). A strided copy takes the scalar loop for all of them."""
    if not _active or type(x) is not torch.Tensor or x.device.type != "cpu":
        return fn(x)
    spread = x.new_empty(*x.shape, 2)[..., 0]
    spread.copy_(x)
    return fn(spread)


@contextlib.contextmanager
def mode(enabled: bool = True):
    """Batch-invariant matmuls and attention in this process while the block runs (a no-op when not enabled)."""
    global _active
    if not enabled or _active:
        yield
        return
    with warnings.catch_warnings():  # torch says it overrides a registered kernel: that is the point
        warnings.simplefilter("ignore")
        library = torch.library.Library("aten", "IMPL")
        library.impl("mm", mm, "CPU")
        library.impl("mm.out", _mm_out, "CPU")
        library.impl("addmm", _addmm, "CPU")
        library.impl("bmm", bmm, "CPU")
    _active = True
    try:
        yield
    finally:
        _active = False
        library._destroy()
