"""CPU ops: fused C kernels (cpu_kernels.c) for RMSNorm, SwiGLU and RoPE, forward and backward, and for the
training loss's cross-entropy and logit gradient; training's causal attention in bf16 on batched GEMMs; a grouped
matmul whose backward writes each expert's gradients in place; the gated delta rule in chunks with an analytic
backward (gated_delta_cpu); the reference ops for the rest.

Each fused op does in one pass over memory what the reference does in several torch ops and temporaries, and
saves less for backward: RMSNorm keeps its input and one fp32 rstd per row, SwiGLU its two inputs (the sigmoid is
recomputed), RoPE nothing. Same math as `reference`, accumulated in fp32 (only the order of additions differs;
tests/test_ops.py holds values and gradients against it). A kernel covers plain CPU tensors whose activations are
all fp32 or all bf16 (bf16 mixed precision: the weights, cos/sin and statistics stay fp32, a bf16 weight is
widened); anything else (another dtype, a DTensor, tracing by torch.compile, tensors of cos/sin that want a
gradient, a machine without a C compiler) takes the reference twin.
"""

import ctypes
import functools
from pathlib import Path

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from speedllm.native import isa, load
from speedllm.ops import IGNORE_INDEX, batch_invariant, gated_delta_cpu, reference
from speedllm.ops.reference import cross_entropy, varlen_attention
from speedllm.ops.gated_delta_cpu import recurrent_gated_delta_rule

__all__ = ["rms_norm", "rotary", "attention", "varlen_attention", "swiglu", "grouped_mm", "cross_entropy",
           "cross_entropy_grad_", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

KERNEL_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}  # the kernels' activation types (cpu_kernels.c)
_SIGNATURES = {
    "rms_norm_fwd": [_P] * 4 + [_L, _L, ctypes.c_float, _I],
    "rms_norm_bwd": [_P] * 7 + [_L, _L, _I],
    "swiglu_fwd": [_P] * 3 + [_L, _I],
    "swiglu_bwd": [_P] * 5 + [_L, _I],
    "rotary": [_P] * 4 + [_L, _L, _L, _I, _I],
    "cross_entropy_grad": [_P] * 3 + [_L, _L, _L, _I],
    "attention_softmax": [_P] * 2 + [_L, _L, _L, ctypes.c_float, _I],
    "attention_softmax_grad": [_P] * 4 + [_L, _L, _L, ctypes.c_float, _I],
}


def kernels():
    """The compiled kernels for the current kernel path (ctypes library), or None where they cannot be built."""
    return _kernels(isa())


@functools.cache
def _kernels(path: str):
    lib = load(KERNEL_SOURCE, path)
    if lib is not None:
        for name, argtypes in _SIGNATURES.items():
            for suffix in _SUFFIX.values():
                getattr(lib, name + suffix).argtypes, getattr(lib, name + suffix).restype = argtypes, None
    return lib


def _kernel(name: str, activations: torch.Tensor):
    """The kernel `name` for the dtype of `activations`."""
    return getattr(kernels(), name + _SUFFIX[activations.dtype])


def _plain(*tensors: torch.Tensor) -> bool:
    """Plain (not DTensor or fake) CPU tensors, outside tracing."""
    return not torch.compiler.is_compiling() and all(
        type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" for t in tensors)


def _fused(*activations: torch.Tensor, params=()) -> bool:
    """Whether the kernels take these tensors: plain CPU tensors, the activations all fp32 or all bf16, the
    params (weights, cos/sin) either, and the kernels are built."""
    return (_plain(*activations, *params) and kernels() is not None and activations[0].dtype in _SUFFIX
            and all(t.dtype == activations[0].dtype for t in activations) and all(p.dtype in _SUFFIX for p in params))


def _threads(numel: int) -> int:
    """torch's thread count, or one thread for a small tensor (a decode step's rows), where waking the OpenMP
    team costs more than the work: at 2 threads it cost 13% of qwen3-42M's batch-1 decode speed."""
    return torch.get_num_threads() if numel >= 1 << 15 else 1


def _ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will want a backward: without one (inference) the kernels are called directly, as
    autograd.Function's own overhead is most of a decode step's small call."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _rms_norm_fwd(x, weight, eps):
    x = x.contiguous()
    y, rstd, w = torch.empty_like(x), torch.empty(x.numel() // x.shape[-1]), weight.float()
    _kernel("rms_norm_fwd", x)(_ptr(x), _ptr(w), _ptr(y), _ptr(rstd), rstd.numel(), x.shape[-1], eps,
                               _threads(x.numel()))
    return x, y, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x, y, rstd = _rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dy, threads = dy.to(x.dtype).contiguous(), _threads(dy.numel())
        dx = torch.empty_like(x)
        dw = torch.empty(weight.shape) if ctx.needs_input_grad[1] else None
        scratch = torch.empty(threads, weight.numel()) if dw is not None else None
        w = weight.float()
        _kernel("rms_norm_bwd", x)(_ptr(dy), _ptr(x), _ptr(w), _ptr(rstd), _ptr(dx),
                                   None if dw is None else _ptr(dw), None if dw is None else _ptr(scratch),
                                   rstd.numel(), x.shape[-1], threads)
        return dx, None if dw is None else dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """In x's dtype: under bf16 autocast (a bf16 x, an fp32 weight) bf16, as the accelerators' op sets, also where
    the kernel does not take the tensors (DTensors under tensor parallelism: q_norm / k_norm run sharded by head)."""
    if not (_fused(x, params=(weight,)) and weight.is_contiguous() and weight.shape == x.shape[-1:]):
        return reference.rms_norm(x, weight, eps).to(x.dtype)
    return _RMSNorm.apply(x, weight, eps) if _needs_grad(x, weight) else _rms_norm_fwd(x, weight, eps)[1]


def _swiglu_fwd(gate, up):
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    _kernel("swiglu_fwd", gate)(_ptr(gate), _ptr(up), _ptr(y), y.numel(), _threads(y.numel()))
    return gate, up, y


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up, y = _swiglu_fwd(gate, up)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.to(gate.dtype).contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _kernel("swiglu_bwd", gate)(_ptr(dy), _ptr(gate), _ptr(up), _ptr(dgate), _ptr(dup), dy.numel(),
                                    _threads(dy.numel()))
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not (_fused(gate, up) and gate.shape == up.shape):
        return reference.swiglu(gate, up)
    return _SwiGLU.apply(gate, up) if _needs_grad(gate, up) else _swiglu_fwd(gate, up)[2]


def _rotary(x, cos, sin, backward: bool):
    x = x.contiguous()
    y, cos, sin = torch.empty_like(x), cos.float(), sin.float()  # kept alive through the call
    B, S, H, Dh = x.shape
    _kernel("rotary", x)(_ptr(x), _ptr(cos), _ptr(sin), _ptr(y), B * S, H, Dh, int(backward), _threads(x.numel()))
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotary(x, cos, sin, backward=False)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotary(dy.to(ctx.dtype), cos, sin, backward=True), None, None


def rotary(x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    B, S, _, Dh = x_BSHD.shape
    if not (_fused(x_BSHD, params=(cos_BSD, sin_BSD)) and Dh % 2 == 0 and cos_BSD.shape == sin_BSD.shape == (B, S, Dh)
            and cos_BSD.is_contiguous() and sin_BSD.is_contiguous()
            and not (cos_BSD.requires_grad or sin_BSD.requires_grad)):
        return reference.rotary(x_BSHD, cos_BSD, sin_BSD)
    return _Rotary.apply(x_BSHD, cos_BSD, sin_BSD) if _needs_grad(x_BSHD) else _rotary(x_BSHD, cos_BSD, sin_BSD, False)


def cross_entropy_grad_(logits_NV: torch.Tensor, labels_N: torch.Tensor):
    """The reference's loss and logit gradient in one pass per row (cpu_kernels.c), in the logits' dtype: bf16
    logits under autocast are read and their gradient written in bf16, with fp32 arithmetic in between."""
    if not (_fused(logits_NV) and logits_NV.dim() == 2 and logits_NV.is_contiguous() and _plain(labels_N)):
        return reference.cross_entropy_grad_(logits_NV, labels_N)
    N, V = logits_NV.shape
    labels = labels_N.to(torch.int64).contiguous()
    if not ((labels == IGNORE_INDEX) | ((labels >= 0) & (labels < V))).all():  # as gather would raise
        raise IndexError(f"cross-entropy: a label outside [0, {V}) that is not {IGNORE_INDEX}")
    loss_N = torch.empty(N)
    _kernel("cross_entropy_grad", logits_NV)(_ptr(logits_NV), _ptr(labels), _ptr(loss_N), N, V, IGNORE_INDEX,
                                             _threads(logits_NV.numel()))
    return loss_N.sum(), logits_NV


class _CausalAttention(torch.autograd.Function):
    """Causal GQA attention for training on batched GEMMs around two fused passes (cpu_kernels.c): the scores
    s = q k^T in fp32, p = softmax(scale s) kept in the activations' dtype, o = p v; backward dp = do v^T in fp32,
    ds = scale p (dp - rowsum(do o)), then dv = p^T do, dq = ds k, dk = ds^T q. The query heads of a kv head are
    stacked, so one GEMM serves a group.

    torch's CPU flash attention backward gains nothing from bf16 (8.8 ms at [4, 8, 256, 64] in bf16, 6.7 in fp32;
    this one 3.9): here the three GEMMs on p and ds run on AMX or AVX512-BF16, and the two whose rounding would move
    the softmax (s, and dp before its difference with the row sum) stay fp32: the gradients are as close to an
    fp32 reference as SDPA's bf16 ones (tests/test_ops.py). Costs B*H*S*T saved elements of p per layer.
    """

    @staticmethod
    @torch.autocast("cpu", enabled=False)  # the fp32 GEMMs stay fp32
    def forward(ctx, q, k, v, scale):
        (B, H, S, Dh), (K, T) = q.shape, k.shape[1:3]
        q_g = q.reshape(B, K, H // K * S, Dh)  # rows: (query head of the group, query)
        s = q_g.float() @ k.float().transpose(-1, -2)
        p = torch.empty(s.shape, dtype=q.dtype)
        _kernel("attention_softmax", p)(_ptr(s), _ptr(p), B * H * S, T, S, scale, _threads(s.numel()))
        out = (p @ v).view(B, H, S, Dh)
        ctx.save_for_backward(q_g, k, v, p, out)
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, do):
        q_g, k, v, p, out = ctx.saved_tensors
        do_g = do.to(p.dtype).reshape(q_g.shape)
        do32 = do_g.float()  # widened once, for dp and for the row sums
        dp = do32 @ v.float().transpose(-1, -2)
        di, ds = (do32 * out.float().view(q_g.shape)).sum(-1), torch.empty_like(p)
        _kernel("attention_softmax_grad", p)(_ptr(p), _ptr(dp), _ptr(di), _ptr(ds), di.numel(), p.shape[-1],
                                             out.shape[2], ctx.scale, _threads(p.numel()))
        return (ds @ k).view(out.shape), ds.transpose(-1, -2) @ q_g, p.transpose(-1, -2) @ do_g, None


_ATTENTION_SCORES = 1 << 23  # the most B*H*S*T for _CausalAttention, which keeps p (16 MB in bf16) per layer


def attention(q, k, v, mask, scale):
    """The reference's attention; training's causal bf16 attention (S == T) through _CausalAttention; the
    fixed-order one in batch-invariant mode."""
    if batch_invariant.active():
        return batch_invariant.attention(q, k, v, mask, scale)
    (B, H, S, Dh), T = q.shape, k.shape[2]
    if (mask is None and S == T > 1 and B * H * S * T <= _ATTENTION_SCORES and _fused(q, k, v)
            and q.dtype == torch.bfloat16 and _needs_grad(q, k, v)):
        return _CausalAttention.apply(q, k, v, Dh ** -0.5 if scale is None else scale)
    return reference.attention(q, k, v, mask, scale)


def chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state=None, cu_seqlens=None):
    """gated_delta_cpu's chunked form; in batch-invariant mode the recurrent form, token by token from the state
    (zeros where none), as a decode step computes it: a prefill, its decode steps and the training forward then
    give a token the same bits (its matmuls are batch-invariant mode's). Slower (a Python step per token, every
    state kept for backward), as the mode is. Packed documents (cu_seqlens) stay chunked."""
    if batch_invariant.active() and cu_seqlens is None:
        if initial_state is None:
            (B, _, H, V), K = v_BSHV.shape, k_BSHK.shape[-1]
            initial_state = torch.zeros(B, H, K, V)
        return recurrent_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state)
    return gated_delta_cpu.chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state, cu_seqlens)


class _GroupedMM(torch.autograd.Function):
    """One mm per expert, each writing its block of the output (and in backward of dx and dw) in place.

    The reference's autograd goes through `w[e]` (select), split and cat: every expert's weight gradient is
    a zero-filled [E, O, D] tensor added into the total, E times per projection, and the blocks are copied
    twice more by cat. On qwen3-moe-60M (8 experts) that was a third of a training step. The mm calls are the
    reference's own (dw[e] as autograd computes it for a transposed weight: dy_e^T x_e), so values are equal.

    Under bf16 autocast on a CPU with a packed bf16 kernel (AMX, AVX512-BF16), each expert's products run on it
    (batch_invariant.mixed_bmm): the fp32 weights and activations are rounded to bf16 as the kernel packs them, so
    no weight is converted outside it, and the weight gradients come out in fp32, unrounded, straight into the
    masters' gradient. The outputs are bf16, as autocast's linear layers give. Without that kernel the experts
    compute in their inputs' dtype (fp32 after an RMSNorm; mm(out=...) is beyond autocast's reach): casting them
    to bf16 outside the kernel, as autocast would, made qwen3-moe-60M's step slower on a 2-core Xeon with AMX,
    0.68-0.77 s -> 0.83-0.85.
    """

    @staticmethod
    def forward(ctx, x_ND, w_EOD, counts_E):
        ctx.splits = counts_E.tolist()
        ctx.save_for_backward(x_ND, w_EOD)
        ctx.low = (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
                   and batch_invariant.mixed_available())
        y_NO = x_ND.new_empty(x_ND.shape[0], w_EOD.shape[1], dtype=torch.bfloat16 if ctx.low else x_ND.dtype)
        for e, (x, y) in enumerate(zip(x_ND.split(ctx.splits), y_NO.split(ctx.splits))):
            if ctx.low:
                batch_invariant.mixed_bmm(x[None], w_EOD[e].t()[None], y[None])
            else:
                torch.mm(x, w_EOD[e].t(), out=y)
        return y_NO

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_NO):
        x_ND, w_EOD = ctx.saved_tensors
        dy_NO = dy_NO.contiguous()
        dx_ND = torch.empty_like(x_ND) if ctx.needs_input_grad[0] else None
        dw_EOD = torch.empty_like(w_EOD) if ctx.needs_input_grad[1] else None
        dx_blocks = dx_ND.split(ctx.splits) if dx_ND is not None else [None] * len(ctx.splits)
        for e, (x, dy, dx) in enumerate(zip(x_ND.split(ctx.splits), dy_NO.split(ctx.splits), dx_blocks)):
            if ctx.low:
                if dx is not None:
                    batch_invariant.mixed_bmm(dy[None], w_EOD[e][None], dx[None])
                if dw_EOD is not None:
                    batch_invariant.mixed_bmm(dy.t()[None], x[None], dw_EOD[e][None])
                continue
            if dx is not None:
                torch.mm(dy, w_EOD[e], out=dx)
            if dw_EOD is not None:
                torch.mm(dy.t(), x, out=dw_EOD[e])  # an expert without rows: zeros
        return dx_ND, dw_EOD, None


def grouped_mm(x_ND: torch.Tensor, w_EOD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    if not (_plain(x_ND, w_EOD) and x_ND.is_contiguous() and w_EOD.is_contiguous()):
        return reference.grouped_mm(x_ND, w_EOD, counts_E)
    return _GroupedMM.apply(x_ND, w_EOD, counts_E)
