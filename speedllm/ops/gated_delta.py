"""The gated delta rule (Gated DeltaNet's token mixer) in plain torch: the reference twin of every device's kernels.

Letters: B batch, S sequence, H value heads, Hk key heads (H a multiple of Hk: each key head serves H / Hk
consecutive value heads), K key head dim, V value head dim, C chunk length.

Per head, with q_t and k_t L2-normalized and q_t scaled by K^-0.5, the state M [K, V] starts at the initial
state (or zero) and for each token t:

    M = exp(g_t) * M                          decay (g_t <= 0, in log space)
    M = M + k_t (beta_t * (v_t - k_t^T M))^T  the delta rule: write the part of v_t that M does not predict
    o_t = q_t^T M

`gated_delta_rule_math` spells this out token by token (the definition the tests hold every form against);
`chunked` computes the same in chunks of C tokens with matrix products (the UT transform of DeltaNet's paper),
which is how training and prefill run.
"""

from typing import Optional

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as fla and transformers normalize q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """fp32 [B, H, S, .] tensors: q and k L2-normalized and repeated to the value heads, q scaled by K^-0.5."""
    groups = v.shape[2] // k.shape[2]
    q, k = (l2norm(x.float()).repeat_interleave(groups, dim=2) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    return [x.transpose(1, 2).float() for x in (q, k, v, g, beta)]


def gated_delta_rule_math(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state=None):
    """The rule token by token (module docstring): (o_BSHV in v's dtype, final state fp32 [B, H, K, V])."""
    q, k, v, g, beta = _prepare(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)
    B, H, S, K = k.shape
    state = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.float()
    outs = []
    for t in range(S):
        state = state * g[:, :, t, None, None].exp()
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k[:, :, t], state))
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out.transpose(1, 2).to(v_BSHV.dtype), state


def _chunked(q, k, v, g, beta, state):
    """One sequence's rule in chunks: prepared fp32 [B, H, S, .] tensors and the fp32 state -> (o [B, H, S, V], state)."""
    S = q.shape[2]
    if S == 0:  # an empty document of a packed batch: the state passes through
        return v, state
    pad = -S % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))  # padded tokens: no decay, no write (beta 0)
    B, H, T, K = k.shape
    q, k, v = (x.view(B, H, T // CHUNK, CHUNK, -1) for x in (q, k, v))
    g, beta = g.view(B, H, T // CHUNK, CHUNK), beta.view(B, H, T // CHUNK, CHUNK)
    cum = g.cumsum(-1)  # log decay from the chunk's start to each token
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay_CC = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + strictly_lower(beta k k^T * decay)) W = [beta v, beta k exp(cum)]: the UT transform
    system = (k_beta @ k.transpose(-1, -2) * decay_CC).tril(-1) + torch.eye(CHUNK, device=q.device)
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1]:]
    attn = q @ k.transpose(-1, -2) * decay_CC
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    outs = []
    for c in range(T // CHUNK):
        v_new = u[:, :, c] - w[:, :, c] @ state
        outs.append(q_decayed[:, :, c] @ state + attn[:, :, c] @ v_new)
        state = state * cum[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=2)[:, :, :S], state


def chunk_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, initial_state=None,
                           cu_seqlens: Optional[torch.Tensor] = None):
    """The rule in chunked form (training, prefill): (o_BSHV in v's dtype, final state fp32 [N, H, K, V]).

    Args:
        q_BSHK, k_BSHK: queries and keys before L2 normalization, [B, S, Hk, K].
        v_BSHV: values [B, S, H, V]. g_BSH: log decay (<= 0). beta_BSH: write strength in (0, 1).
        initial_state: fp32 [N, H, K, V] or None (zeros); N = B, or the number of documents with cu_seqlens.
        cu_seqlens: packed documents (B == 1): int32 [N + 1] token offsets; the state restarts at each
            document and one final state per document is returned.
    """
    q, k, v, g, beta = _prepare(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH)
    bounds = [0, q.shape[2]] if cu_seqlens is None else cu_seqlens.tolist()
    N = q.shape[0] if cu_seqlens is None else len(bounds) - 1
    if initial_state is None:
        initial_state = q.new_zeros(N, q.shape[1], q.shape[-1], v.shape[-1])
    outs, states = [], []
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        rows = slice(None) if cu_seqlens is None else slice(i, i + 1)
        out, state = _chunked(*(x[:, :, lo:hi] for x in (q, k, v, g, beta)), initial_state[rows].float())
        outs.append(out)
        states.append(state)
    return torch.cat(outs, dim=2).transpose(1, 2).to(v_BSHV.dtype), torch.cat(states)


def recurrent_gated_delta_rule(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state):
    """The rule token by token from `state` (decode): (o_BSHV in v's dtype, the new state fp32 [B, H, K, V])."""
    return gated_delta_rule_math(q_BSHK, k_BSHK, v_BSHV, g_BSH, beta_BSH, state)
