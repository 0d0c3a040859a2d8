"""The gated delta rule on CPU: the chunked form as an autograd Function with an analytic backward, and a
decode step of a few fused torch ops. Same math as speedllm.ops.gated_delta (the reference twin, whose letters
and docstring this module follows); fp32 arithmetic whatever the inputs' dtype (fp32 or bf16).

Chunked form. Every document (a batch row, or a packed document of cu_seqlens) is cut into chunks of C tokens
(the last one padded: no decay, no write). The per-chunk work (the UT transform, the intra-chunk attention, every
gradient but the state's) is batched matmuls over [chunks, heads], a block of chunks at a time (BLOCK); only the
state passes from chunk to chunk, in a scan of two matmuls per step (four in backward). The documents are sorted
by length and the chunks laid out step-major (every document's chunk 0, then every chunk 1 of the documents that
have one, ...), so step j reads one contiguous slice and the documents still running are a prefix of the state:
packed documents run side by side, not one after another.

Per chunk, with b the cumulative log decay from the chunk's start, G = b at its end, h the state at its start,
D_ij = exp(b_i - b_j) for i >= j (else 0), A = strictly_lower(beta_i (k_i . k_j) D_ij), T = (I + A)^-1:

    u = T (beta v)    w = T (beta exp(b) k)                     (the UT transform)
    v_new = u - w h                                              (what h does not predict)
    o = (exp(b) q) h + ((q k^T) * D) v_new
    h' = exp(G) h + (exp(G - b) k)^T v_new

Forward saves the inputs and the state at each chunk's start; backward recomputes the per-chunk quantities,
runs the scan in reverse for the state's gradient (dh = exp(G) dh' + (exp(b) q)^T do - w^T dv_new), and the
rest in batch, block by block in reverse, as flash-linear-attention's chunk_gated_delta_rule backward does. The inverse T comes from a C
kernel (gated_delta_kernels.c); without a C compiler the reference twin runs.

Letters (as speedllm.ops.gated_delta): B batch, S sequence, H value heads, Hk key heads, K key dim, V value
dim, C chunk length; N documents, T tokens (B * S), M chunks of all documents (m: of a block).
"""

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from speedllm.native import c_function
from speedllm.ops import gated_delta
from speedllm.ops.batch_invariant import elementwise
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


# (chunk, value head) pairs whose per-chunk work is done at once (whole scan steps, at least one): bounds the
# temporaries, ~30 of a block's size (1-2 MiB at K = V = 64..128): at B = 4, S = 512, H = 8, K = V = 64 the peak
# was 132 MiB with one block of 32 chunks (transformers' fallback 129), 40 with blocks of 8
BLOCK = 64


@dataclass(frozen=True)
class _Layout:
    """Where each token sits among the chunks (module docstring). token [M, C]: the token in each chunk slot
    (padding: token 0, its values never read: beta, g and do are zeroed there); pad [M, C]: which slots are
    padding; slot [T]: each token's chunk and position in it (m * C + c); order [N]: the documents by length,
    longest first; blocks: per block of about BLOCK chunks, its chunks (lo, hi) and its scan steps, each the
    number of documents at that step and their chunks' slice within the block."""

    token: torch.Tensor
    pad: torch.Tensor
    slot: torch.Tensor
    order: torch.Tensor
    blocks: tuple


def _layout(lengths: list, starts: list, total: int, heads: int) -> _Layout:
    chunks = [-(-n // CHUNK) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda d: -chunks[d])
    active = [sum(chunks[d] > j for d in order) for j in range(max(chunks, default=0))]
    offsets = [sum(active[:j]) for j in range(len(active))]
    blocks, steps = [], []
    for j, (a, o) in enumerate(zip(active, offsets)):
        lo = o - sum(n for n, _ in steps)
        steps.append((a, slice(o - lo, o - lo + a)))
        if (o + a - lo) * heads >= BLOCK or j == len(active) - 1:
            blocks.append((lo, o + a, tuple(steps)))
            steps = []
    step = torch.repeat_interleave(torch.arange(len(active)), torch.tensor(active, dtype=torch.long))
    rank = torch.arange(len(step)) - torch.tensor(offsets, dtype=torch.long)[step]  # the document's rank by length
    length, start = (torch.tensor([values[d] for d in order], dtype=torch.long)[rank] for values in (lengths, starts))
    position = step[:, None] * CHUNK + torch.arange(CHUNK)
    pad = position >= length[:, None]
    token = torch.where(pad, 0, start[:, None] + position)
    slot = torch.empty(total, dtype=torch.long)
    slot[token[~pad]] = torch.arange(token.numel()).view(token.shape)[~pad]
    return _Layout(token, pad, slot, torch.tensor(order), tuple(blocks))


def _to_chunks(x_TH: torch.Tensor, token_MC: torch.Tensor) -> torch.Tensor:
    """Token tensor [T, H] or [T, H, D] -> fp32 chunks [M, H, C] or [M, H, C, D] of the tokens `token_MC` (one
    gather)."""
    T, H = x_TH.shape[:2]
    rows = token_MC[:, None, :] * H + torch.arange(H)[:, None]
    return x_TH.reshape(T * H, -1).index_select(0, rows.flatten()).view(*rows.shape, *x_TH.shape[2:]).float()


def _from_chunks(x_MHC: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """Chunks [M, H, C] or [M, H, C, D] -> token tensor [T, H] or [T, H, D] (padding dropped; one gather)."""
    M, H, C = x_MHC.shape[:3]
    m, c = layout.slot // C, layout.slot % C
    rows = (m[:, None] * H + torch.arange(H)) * C + c[:, None]
    return x_MHC.reshape(M * H * C, -1).index_select(0, rows.flatten()).view(*rows.shape, *x_MHC.shape[3:])


def _zero_padding(x_MHC: torch.Tensor, pad_MC: torch.Tensor) -> torch.Tensor:
    return x_MHC.masked_fill_(pad_MC.view(-1, 1, CHUNK, *[1] * (x_MHC.dim() - 3)), 0.0)


def _normalized(x_THK: torch.Tensor, scale: float = 1.0):
    """(x L2-normalized in fp32, times `scale`; the inverse norms) for the op's q and k."""
    x = x_THK.float()
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # as gated_delta.l2norm
    return x * (rstd * scale), rstd


class _Chunks:
    """The per-chunk quantities of the module docstring for the chunks [lo, hi), fp32. A key head serves
    G = H / Hk value heads: value-head tensors are [m, Hk, G, C, ...] (the same memory as [m, H, C, ...]), key-head
    ones [m, Hk, 1, C, ...], so q k^T and k k^T are computed once per key head and nothing is repeated.

    Args:
        q_THK, k_THK: q and k normalized (q scaled), fp32. The rest: the op's token tensors.
    """

    def __init__(self, q_THK, k_THK, v_THV, g_TH, beta_TH, layout: _Layout, lo: int, hi: int):
        token, pad = layout.token[lo:hi], layout.pad[lo:hi]
        Hk = k_THK.shape[1]
        value_heads = lambda x: x.view(x.shape[0], Hk, -1, *x.shape[2:])  # noqa: E731
        self.q, self.k = (_to_chunks(x, token)[:, :, None] for x in (q_THK, k_THK))
        self.v = value_heads(_to_chunks(v_THV, token))
        self.beta = value_heads(_zero_padding(_to_chunks(beta_TH, token), pad))
        self.b = value_heads(_zero_padding(_to_chunks(g_TH, token), pad).cumsum(-1))
        causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
        self.decay_CC = (self.b[..., :, None] - self.b[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()
        self.kk = self.k @ self.k.transpose(-1, -2)
        self.t = tril_unit_inverse(self.kk * (self.decay_CC * self.beta[..., None]))
        self.exp_b = self.b.exp()
        self.exp_G = self.exp_b[..., -1]  # the decay over the whole chunk [m, Hk, G]
        self.u = self.t @ (self.v * self.beta[..., None])
        self.w = self.t @ (self.k * (self.exp_b * self.beta)[..., None])
        self.q_d = self.q * self.exp_b[..., None]  # reads the chunk's start state
        self.to_end = (self.b[..., -1:] - self.b).exp()
        self.k_d = self.k * self.to_end[..., None]  # writes the chunk's end state
        self.qk = self.q @ self.k.transpose(-1, -2)
        self.p = self.qk * self.decay_CC


def _heads(x):
    """A value-head tensor [m, Hk, G, ...] as [m, H, ...]."""
    return x.flatten(1, 2)


def _t(x):
    return x.transpose(-1, -2)


def _minus_w_h(u, w, h):
    """u - w h over the leading dims (one baddbmm)."""
    return torch.baddbmm(u.flatten(0, -3), w.flatten(0, -3), h.flatten(0, -3), alpha=-1).view(u.shape)


class _ChunkGatedDelta(torch.autograd.Function):
    """The chunked rule over token tensors q, k [T, Hk, K], v [T, H, V], g, beta [T, H] and the documents'
    initial states [N, H, K, V] -> (o [T, H, V] in v's dtype, final states fp32 [N, H, K, V]). Block by block
    of chunks: the per-chunk quantities of a block, then its scan steps, then its outputs (backward: the same in
    reverse order)."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)  # fp32 matmuls whatever autocast is on outside
    def forward(ctx, q, k, v, g, beta, initial_state, layout):
        qn, _ = _normalized(q, q.shape[-1] ** -0.5)
        kn, _ = _normalized(k)
        M, (T, H, V), K = layout.token.shape[0], v.shape, k.shape[-1]
        state = initial_state.float()[layout.order]  # a copy: advanced in place, document by rank
        starts, o = torch.empty(M, H, K, V), torch.empty(M, H, CHUNK, V)
        for lo, hi, steps in layout.blocks:
            c = _Chunks(qn, kn, v, g, beta, layout, lo, hi)
            u, w, k_d, exp_G = map(_heads, (c.u, c.w, c.k_d, c.exp_G))
            block_starts, v_new = starts[lo:hi], torch.empty_like(u)
            for a, chunk in steps:
                h = state[:a]
                block_starts[chunk] = h
                v_new[chunk] = _minus_w_h(u[chunk], w[chunk], h)
                state[:a] = h * exp_G[chunk][..., None, None] + _t(k_d[chunk]) @ v_new[chunk]
            torch.matmul(_heads(c.q_d), block_starts, out=o[lo:hi])
            o[lo:hi] += _heads(c.p) @ v_new
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
        K = k.shape[-1]
        qn, q_rstd = _normalized(q, K ** -0.5)
        kn, k_rstd = _normalized(k)
        M, Hk, H, V = starts.shape[0], k.shape[1], v.shape[1], v.shape[-1]
        dq, dk = torch.empty(M, Hk, CHUNK, K), torch.empty(M, Hk, CHUNK, K)
        dv, dg, dbeta = torch.empty(M, H, CHUNK, V), torch.empty(M, H, CHUNK), torch.empty(M, H, CHUNK)
        dstate = dfinal.float()[layout.order]  # a copy, by rank: the gradient at each document's end
        for lo, hi, steps in reversed(layout.blocks):
            c = _Chunks(qn, kn, v, g, beta, layout, lo, hi)
            value_heads = lambda x: x.view(c.v.shape[:3] + x.shape[2:])  # noqa: E731
            block_starts = starts[lo:hi]
            do = _zero_padding(_to_chunks(do_THV, layout.token[lo:hi]), layout.pad[lo:hi])
            u, w, k_d, q_d, exp_G = map(_heads, (c.u, c.w, c.k_d, c.q_d, c.exp_G))
            v_new = _minus_w_h(u, w, block_starts)
            dv_new = _t(_heads(c.p)) @ do  # the local part; the state's is added in the scan
            dk_d, dG = torch.empty_like(k_d), torch.empty_like(exp_G)
            for a, chunk in reversed(steps):
                dh = dstate[:a]  # the gradient of the state at the chunk's end
                dv_new[chunk] += k_d[chunk] @ dh
                dk_d[chunk] = v_new[chunk] @ _t(dh)
                dG[chunk] = (block_starts[chunk] * dh).sum((-1, -2)) * exp_G[chunk]
                dstate[:a] = (dh * exp_G[chunk][..., None, None] + _t(q_d[chunk]) @ do[chunk]
                              - _t(w[chunk]) @ dv_new[chunk])
            # o = q_d starts + p v_new (p = qk * decay)
            dq_d = value_heads(do @ _t(block_starts))
            db = (c.q_d * dq_d).sum(-1)
            dqk = value_heads(do @ _t(v_new)) * c.decay_CC
            dp_p = dqk * c.qk
            db += dp_p.sum(-1) - dp_p.sum(-2)
            dqk = dqk.sum(2)  # over the value heads of a key head [m, Hk, C, C]
            torch.add((dq_d * c.exp_b[..., None]).sum(2), dqk @ c.k[:, :, 0], out=dq[lo:hi])
            dk_block = _t(dqk) @ c.q[:, :, 0]
            # h' = exp(G) h + k_d^T v_new
            dk_d = value_heads(dk_d)
            dk_d_k_d = (c.k_d * dk_d).sum(-1)
            db -= dk_d_k_d
            dG = value_heads(dG) + dk_d_k_d.sum(-1)
            dk_value = dk_d * c.to_end[..., None]
            # v_new = u - w h; u = T (beta v), w = T (beta exp(b) k): dw = -dv_new h^T, so dk_beta = -dk_beta_neg
            dv_beta = _t(c.t) @ value_heads(dv_new)
            dk_beta_neg = _t(c.t) @ value_heads(dv_new @ _t(block_starts))
            torch.mul(_heads(dv_beta), _heads(c.beta)[..., None], out=dv[lo:hi])
            dk_e = -(c.k * dk_beta_neg).sum(-1) * c.exp_b  # d(beta) through w, per row
            dbeta_block = (c.v * dv_beta).sum(-1) + dk_e
            dk_value -= dk_beta_neg * (c.beta * c.exp_b)[..., None]
            db += c.beta * dk_e
            # T = (I + A)^-1, A = strictly_lower(beta_i kk_ij decay_ij): dA = -(dv_beta u^T + dk_beta w^T)
            da = (dk_beta_neg @ _t(c.w) - dv_beta @ _t(c.u)).tril_(-1) * c.decay_CC
            da_kk = da * c.kk
            dbeta_block += da_kk.sum(-1)
            dbeta[lo:hi] = _heads(dbeta_block)
            da_kk *= c.beta[..., None]
            db += da_kk.sum(-1) - da_kk.sum(-2)
            dkk = (da * c.beta[..., None]).sum(2)
            dk[lo:hi] = dk_block + dk_value.sum(2) + (dkk + _t(dkk)) @ c.k[:, :, 0]
            # b = cumsum(g), G = b at the chunk's end
            db[..., -1] += dG
            dg[lo:hi] = _heads(db.flip(-1).cumsum(-1).flip(-1))
        dq = _l2norm_grad(_from_chunks(dq, layout), q, q_rstd, K ** -0.5)
        dk = _l2norm_grad(_from_chunks(dk, layout), k, k_rstd)
        dinitial = torch.empty_like(dstate)
        dinitial[layout.order] = dstate
        return (dq.to(q.dtype), dk.to(k.dtype), _from_chunks(dv, layout).to(v.dtype), _from_chunks(dg, layout).to(g.dtype),
                _from_chunks(dbeta, layout).to(beta.dtype), dinitial, None)


def _l2norm_grad(dy, x, rstd, scale: float = 1.0):
    """d/dx of y = x * rstd * scale (rstd = 1 / |x|): rstd scale (dy - xn (xn . dy)), xn = x * rstd."""
    xn = x.float() * rstd
    return (rstd * scale) * (dy - xn * (xn * dy).sum(-1, keepdim=True))


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
                                      _layout(lengths, starts, B * S, H))
    return o.view(v_BSHV.shape), final


def recurrent_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state):
    """speedllm.ops.gated_delta.recurrent_gated_delta_rule (same arguments and results): per token a handful of
    fused ops on the state viewed as [B, Hk, H / Hk, K, V], so a key head serves its value heads without copies."""
    B, S, Hk, K = k_BSHK.shape
    H, V = v_BSHV.shape[2:]
    q, k = (l2norm(x.float()).view(B, S, Hk, 1, 1, K) for x in (q_BSHK, k_BSHK))
    q = q * K ** -0.5
    v = v_BSHV.float().view(B, S, Hk, H // Hk, 1, V)
    decay, beta = (x.float().view(B, S, Hk, H // Hk, 1, 1) for x in (elementwise(torch.exp, g_BSH), beta_BSH))
    state = state.float().view(B, Hk, H // Hk, K, V)
    outs = []
    for t in range(S):
        state = state * decay[:, t]
        delta = beta[:, t] * (v[:, t] - k[:, t] @ state)  # [B, Hk, H / Hk, 1, V]
        state = state + k[:, t].transpose(-1, -2) * delta
        outs.append(q[:, t] @ state)
    out = outs[0] if S == 1 else torch.stack(outs, 1)
    return out.reshape(v_BSHV.shape).to(v_BSHV.dtype), state.view(B, H, K, V)
