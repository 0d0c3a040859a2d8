"""The gated delta rule on CPU: the chunked form as an autograd Function with an analytic backward, and a
decode step of a few fused torch ops. Same math as speedllm.ops.gated_delta (the reference twin, whose letters
and docstring this module follows); fp32 arithmetic whatever the inputs' dtype (fp32 or bf16).

Chunked form. Every document (a batch row, or a packed document of cu_seqlens) is cut into chunks of C tokens
(the last one padded: no decay, no write). All chunks of all documents sit in one batch, so the per-chunk work
(the UT transform, the intra-chunk attention, every gradient but the state's) is batched matmuls over
[chunks, heads]; only the state passes from chunk to chunk, in a scan of two matmuls per step. The documents
are sorted by length and the chunks laid out step-major (every document's chunk 0, then every chunk 1 of the
documents that have one, ...), so step j reads one contiguous slice and the documents still running are a
prefix of the state: packed documents run side by side, not one after another.

Per chunk, with b the cumulative log decay from the chunk's start, G = b at its end, h the state at its start,
D_ij = exp(b_i - b_j) for i >= j (else 0), A = strictly_lower(beta_i (k_i . k_j) D_ij), T = (I + A)^-1:

    u = T (beta v)    w = T (beta exp(b) k)                     (the UT transform)
    v_new = u - w h                                              (what h does not predict)
    o = (exp(b) q) h + ((q k^T) * D) v_new
    h' = exp(G) h + (exp(G - b) k)^T v_new

Forward saves the inputs and the state at each chunk's start; backward recomputes the per-chunk quantities,
runs the scan in reverse for the state's gradient (dh = exp(G) dh' + (exp(b) q)^T do - w^T dv_new), and the
rest in batch, as flash-linear-attention's chunk_gated_delta_rule backward does. The inverse T comes from a C
kernel (gated_delta_kernels.c); without a C compiler the reference twin runs.

Letters (as speedllm.ops.gated_delta): B batch, S sequence, H value heads, Hk key heads, K key dim, V value
dim, C chunk length; N documents, T tokens (B * S), M chunks of all documents, J scan steps (most chunks of a
document).
"""

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from speedllm.native import c_function
from speedllm.ops import gated_delta
from speedllm.ops.gated_delta import CHUNK, l2norm

KERNEL_SOURCE = Path(__file__).with_name("gated_delta_kernels.c")
_ARGTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int)
_DTYPES = (torch.float32, torch.bfloat16)


def kernel():
    """The compiled tril_unit_inverse for the current kernel path (ctypes), or None where it cannot be built."""
    return c_function(KERNEL_SOURCE, "tril_unit_inverse", _ARGTYPES)


def tril_unit_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + strictly_lower(a))^-1 for a batch a [..., C, C] of fp32 matrices (gated_delta_kernels.c)."""
    a = a.contiguous()
    t = torch.empty_like(a)
    C = a.shape[-1]
    kernel()(ctypes.c_void_p(a.data_ptr()), ctypes.c_void_p(t.data_ptr()), a.numel() // (C * C), C,
             torch.get_num_threads())
    return t


@dataclass(frozen=True)
class _Layout:
    """Where each token sits among the chunks (module docstring). index [M * C]: the token of each chunk slot
    (T: padding, a zero row); inverse [T]: each token's slot; order [N]: the documents by length, longest first;
    active[j], offsets[j]: how many chunks step j holds and where they start."""

    index: torch.Tensor
    inverse: torch.Tensor
    order: torch.Tensor
    active: tuple
    offsets: tuple


def _layout(lengths: list, starts: list, total: int) -> _Layout:
    chunks = [-(-n // CHUNK) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda d: -chunks[d])
    active = tuple(sum(chunks[d] > j for d in order) for j in range(max(chunks, default=0)))
    offsets = tuple(sum(active[:j]) for j in range(len(active)))
    step = torch.repeat_interleave(torch.arange(len(active)), torch.tensor(active, dtype=torch.long))
    rank = torch.arange(len(step)) - torch.tensor(offsets, dtype=torch.long)[step]  # the document's rank by length
    length, start = (torch.tensor([values[d] for d in order], dtype=torch.long)[rank] for values in (lengths, starts))
    position = step[:, None] * CHUNK + torch.arange(CHUNK)
    index = torch.where(position < length[:, None], start[:, None] + position, total).flatten()
    inverse = torch.empty(total, dtype=torch.long)
    real = index < total
    inverse[index[real]] = torch.arange(index.numel())[real]
    return _Layout(index, inverse, torch.tensor(order), active, offsets)


def _to_chunks(x_TH: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Token tensor [T, H, ...] -> fp32 chunks [M, H, C, ...] (padding zero)."""
    padded = torch.cat([x_TH.float(), x_TH.new_zeros(1, *x_TH.shape[1:], dtype=torch.float32)])
    chunks = padded[layout.index]
    return chunks.view(-1, CHUNK, *chunks.shape[1:]).transpose(1, 2).contiguous()


def _from_chunks(x_MHC: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Chunks [M, H, C, ...] -> token tensor [T, H, ...] (padding dropped)."""
    return x_MHC.transpose(1, 2).flatten(0, 1)[layout.inverse]


def _normalized(x_THK: torch.Tensor):
    """(x L2-normalized in fp32, the inverse norms) for the op's q and k."""
    x = x_THK.float()
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # as gated_delta.l2norm
    return x * rstd, rstd


class _Chunks:
    """The per-chunk quantities of the module docstring, fp32 [M, H, C, ...], from the op's token tensors."""

    def __init__(self, q_THK, k_THK, v_THV, g_TH, beta_TH, layout: _Layout):
        groups, K = v_THV.shape[1] // k_THK.shape[1], k_THK.shape[-1]
        self.qn, self.q_rstd = _normalized(q_THK)
        self.kn, self.k_rstd = _normalized(k_THK)
        self.q = _to_chunks(self.qn * K ** -0.5, layout).repeat_interleave(groups, dim=1)
        self.k = _to_chunks(self.kn, layout).repeat_interleave(groups, dim=1)
        self.v, self.beta = _to_chunks(v_THV, layout), _to_chunks(beta_TH, layout)
        self.b = _to_chunks(g_TH, layout).cumsum(-1)
        causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
        self.decay_CC = (self.b[..., :, None] - self.b[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        self.kk = self.k @ self.k.transpose(-1, -2)
        self.t = tril_unit_inverse(self.kk * self.decay_CC * self.beta[..., None])
        self.exp_b = self.b.exp()
        self.exp_G = self.exp_b[..., -1]  # the decay over the whole chunk [M, H]
        self.u = self.t @ (self.v * self.beta[..., None])
        self.k_e = self.k * self.exp_b[..., None]
        self.w = self.t @ (self.k_e * self.beta[..., None])
        self.q_d = self.q * self.exp_b[..., None]  # reads the chunk's start state
        self.k_d = self.k * (self.b[..., -1:] - self.b).exp()[..., None]  # writes the chunk's end state
        self.qk = self.q @ self.k.transpose(-1, -2)
        self.p = self.qk * self.decay_CC


def _steps(layout: _Layout):
    """(j, number of documents at step j, their slice of the chunks) for each scan step j."""
    return [(j, a, slice(o, o + a)) for j, (a, o) in enumerate(zip(layout.active, layout.offsets))]


class _ChunkGatedDelta(torch.autograd.Function):
    """The chunked rule over token tensors q, k [T, Hk, K], v [T, H, V], g, beta [T, H] and the documents'
    initial states [N, H, K, V] -> (o [T, H, V] in v's dtype, final states fp32 [N, H, K, V])."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)  # fp32 matmuls whatever autocast is on outside
    def forward(ctx, q, k, v, g, beta, initial_state, layout):
        c = _Chunks(q, k, v, g, beta, layout)
        state = initial_state.float()[layout.order]  # a copy: advanced in place, document by rank
        starts, v_new = torch.empty(*c.u.shape[:2], *state.shape[-2:]), torch.empty_like(c.u)
        for j, a, chunk in _steps(layout):
            h = state[:a]
            starts[chunk] = h
            v_new[chunk] = c.u[chunk] - c.w[chunk] @ h
            state[:a] = h * c.exp_G[chunk][..., None, None] + c.k_d[chunk].transpose(-1, -2) @ v_new[chunk]
        o = c.q_d @ starts + c.p @ v_new
        final = torch.empty_like(state)
        final[layout.order] = state
        ctx.save_for_backward(q, k, v, g, beta, starts)
        ctx.layout = layout
        return _from_chunks(o, layout).to(v.dtype), final

    @staticmethod
    @once_differentiable
    @torch.autocast("cpu", enabled=False)
    def backward(ctx, do_THV, dfinal):
        q, k, v, g, beta, starts = ctx.saved_tensors
        layout = ctx.layout
        c = _Chunks(q, k, v, g, beta, layout)
        do = _to_chunks(do_THV, layout)
        v_new = c.u - c.w @ starts
        dv_new_local = c.p.transpose(-1, -2) @ do
        dstate = dfinal.float()[layout.order]  # a copy, by rank: the gradient at each document's end
        dv_new, dk_d, dG = torch.empty_like(v_new), torch.empty_like(c.k), torch.empty_like(c.exp_G)
        for j, a, chunk in reversed(_steps(layout)):
            dh = dstate[:a]  # the gradient of the state at the chunk's end
            dv_new[chunk] = dv_new_local[chunk] + c.k_d[chunk] @ dh
            dk_d[chunk] = v_new[chunk] @ dh.transpose(-1, -2)
            dG[chunk] = (starts[chunk] * dh).sum((-1, -2)) * c.exp_G[chunk]
            dstate[:a] = (dh * c.exp_G[chunk][..., None, None] + c.q_d[chunk].transpose(-1, -2) @ do[chunk]
                          - c.w[chunk].transpose(-1, -2) @ dv_new[chunk])
        # o = q_d starts + p v_new
        dq_d = do @ starts.transpose(-1, -2)
        dq = dq_d * c.exp_b[..., None]
        db = (c.q_d * dq_d).sum(-1)
        dp = do @ v_new.transpose(-1, -2)
        dqk = dp * c.decay_CC
        dq = dq + dqk @ c.k
        dk = dqk.transpose(-1, -2) @ c.q
        dp_p = dp * c.p
        db = db + dp_p.sum(-1) - dp_p.sum(-2)
        # h' = exp(G) h + k_d^T v_new
        dk = dk + dk_d * (c.b[..., -1:] - c.b).exp()[..., None]
        dk_d_k_d = (c.k_d * dk_d).sum(-1)
        db = db - dk_d_k_d
        dG = dG + dk_d_k_d.sum(-1)
        # v_new = u - w h; u = T (beta v), w = T (beta k_e)
        dw = -(dv_new @ starts.transpose(-1, -2))
        dv_beta = c.t.transpose(-1, -2) @ dv_new
        dk_beta = c.t.transpose(-1, -2) @ dw
        dv = dv_beta * c.beta[..., None]
        dk_e = (c.k_e * dk_beta).sum(-1)
        dbeta = (c.v * dv_beta).sum(-1) + dk_e
        dk = dk + dk_beta * (c.beta * c.exp_b)[..., None]
        db = db + c.beta * dk_e
        # T = (I + A)^-1, A = strictly_lower(beta_i kk_ij decay_ij)
        da = -(dv_beta @ c.u.transpose(-1, -2) + dk_beta @ c.w.transpose(-1, -2)).tril(-1)
        da_kk_decay = da * c.kk * c.decay_CC
        dbeta = dbeta + da_kk_decay.sum(-1)
        da_a = da_kk_decay * c.beta[..., None]
        db = db + da_a.sum(-1) - da_a.sum(-2)
        dkk = da * c.decay_CC * c.beta[..., None]
        dk = dk + (dkk + dkk.transpose(-1, -2)) @ c.k
        # b = cumsum(g), G = b at the chunk's end
        db[..., -1] += dG
        dg = db.flip(-1).cumsum(-1).flip(-1)
        K, groups = k.shape[-1], v.shape[1] // k.shape[1]
        dq = _l2norm_grad(_group_sum(_from_chunks(dq, layout), groups) * K ** -0.5, c.qn, c.q_rstd)
        dk = _l2norm_grad(_group_sum(_from_chunks(dk, layout), groups), c.kn, c.k_rstd)
        dinitial = torch.empty_like(dstate)
        dinitial[layout.order] = dstate
        return (dq.to(q.dtype), dk.to(k.dtype), _from_chunks(dv, layout).to(v.dtype),
                _from_chunks(dg, layout).to(g.dtype), _from_chunks(dbeta, layout).to(beta.dtype), dinitial, None)


def _group_sum(x_THK: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of a key head repeated to `groups` consecutive value heads: their sum."""
    return x_THK.view(x_THK.shape[0], -1, groups, x_THK.shape[-1]).sum(2)


def _l2norm_grad(dy, y, rstd):
    """d/dx of y = x * rstd: rstd (dy - y (y . dy))."""
    return rstd * (dy - y * (y * dy).sum(-1, keepdim=True))


def _takes(*tensors) -> bool:
    """Whether the CPU forms take these tensors: plain CPU tensors (not DTensor or fake) in fp32 or bf16,
    outside tracing, and the kernel is built."""
    return (not torch.compiler.is_compiling() and kernel() is not None
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype in _DTYPES
                    for t in tensors))


def chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state=None, cu_seqlens=None):
    """speedllm.ops.gated_delta.chunk_gated_delta_rule (same arguments and results) by _ChunkGatedDelta."""
    if not _takes(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, *([] if initial_state is None else [initial_state])):
        return gated_delta.chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state, cu_seqlens)
    B, S, H, V = v_BSHV.shape
    if cu_seqlens is None:
        lengths, starts = [S] * B, [b * S for b in range(B)]
    else:
        bounds = cu_seqlens.tolist()
        lengths, starts = [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])], bounds[:-1]
    if initial_state is None:
        initial_state = torch.zeros(len(lengths), H, k_BSHK.shape[-1], V)
    tokens = lambda x: x.reshape(B * S, *x.shape[2:])  # noqa: E731
    o, final = _ChunkGatedDelta.apply(*map(tokens, (q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)), initial_state,
                                      _layout(lengths, starts, B * S))
    return o.view(v_BSHV.shape), final


def recurrent_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state):
    """speedllm.ops.gated_delta.recurrent_gated_delta_rule (same arguments and results): per token a handful of
    fused ops on the state viewed as [B, Hk, H / Hk, K, V], so a key head serves its value heads without copies."""
    B, S, Hk, K = k_BSHK.shape
    H, V = v_BSHV.shape[2:]
    q, k = (l2norm(x.float()).view(B, S, Hk, 1, 1, K) for x in (q_BSHK, k_BSHK))
    q = q * K ** -0.5
    v = v_BSHV.float().view(B, S, Hk, H // Hk, 1, V)
    decay, beta = (x.float().view(B, S, Hk, H // Hk, 1, 1) for x in (g_BSH.exp(), beta_BSH))
    state = state.float().view(B, Hk, H // Hk, K, V)
    outs = []
    for t in range(S):
        state = state * decay[:, t]
        delta = beta[:, t] * (v[:, t] - k[:, t] @ state)  # [B, Hk, H / Hk, 1, V]
        state = state + k[:, t].transpose(-1, -2) * delta
        outs.append(q[:, t] @ state)
    out = outs[0] if S == 1 else torch.stack(outs, 1)
    return out.reshape(v_BSHV.shape).to(v_BSHV.dtype), state.view(B, H, K, V)
