"""Context parallelism: each rank of the cp axis holds part of every sequence (parallel.cp_mode picks how
attention sees the rest).

Load balancing for causal attention: a sequence of S tokens is cut into 2*cp chunks and rank r keeps chunks
r and 2*cp-1-r, so every rank has as many early (cheap) as late (expensive) query positions. A forward
pre-hook on the model cuts tokens, labels and positions (per-document RoPE positions of packed rows stay
as they are) and passes the forward an `attend` function that knows the layout; document ids never leave
the hook (every cp rank has the whole batch, so it knows every token's document without communication).

  allgather  all-gather K/V of the whole sequence, mask by position and document      K/V memory: S
  ring       K/V blocks travel round the cp ranks; each block's partial attention is
             merged by its log-sum-exp (online softmax) and recomputed in backward    scores: one block
  ulysses    all-to-all heads <-> sequence: each rank attends over the whole
             sequence for H / cp heads with the op set's (varlen) attention           needs H % cp == 0
  hybrid     ulysses inside groups of parallel.cp_ulysses ranks, ring across them

Gated DeltaNet layers (hybrid models) keep the load-balanced layout: the 2*cp chunks in sequence order are held by
ranks 0, 1, ..., cp-1, cp-1, ..., 1, 0, so the recurrent state (and the conv's last W-1 inputs) is carried in that
order: the rank holding chunk c runs it in chunked form from the carried state, then broadcasts the new state over
the cp ranks (2*cp - 1 small collectives per layer, state-sized: no K/V, no relayout). The broadcasts form one chain
on every rank, so backward sums each state's gradient onto its holder in the same order everywhere. Packed
documents: a chunk that starts a document starts from a zero state, and conv inputs of another document are zeroed.

The model's loss is summed over the cp ranks, so every cp rank returns the whole sequence's loss, while each
rank's gradient stays its own share (the data-parallel reduction over dp x cp sums them); MoE routing
statistics are summed the same way, so the load-balancing loss is the whole sequence's.

Letters: B batch, S sequence (L: the positions a rank holds), H/K query/kv heads, D head dim, T keys.
"""

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from speedllm.models.qwen3 import document_bounds, masked_attention, varlen_attention

CP_MODES = ("allgather", "ring", "ulysses", "hybrid")
RING_QUERY_CHUNK = 512  # queries per recomputed piece of a ring block (bounds backward's score temporaries)


def local_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Sequence positions held by `cp_rank`: chunks cp_rank and 2*cp-1-cp_rank of 2*cp."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


class _GatherSequence(torch.autograd.Function):
    """All-gather [B, L, K, D] along the sequence in rank order; backward sums the gradients and keeps ours."""

    @staticmethod
    def forward(ctx, x_BLKD, group):
        ctx.group = group
        parts = [torch.empty_like(x_BLKD) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_BLKD.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad_BSKD):
        grad = grad_BSKD.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad.chunk(dist.get_world_size(ctx.group), dim=1)[dist.get_rank(ctx.group)], None


class _RingShift(torch.autograd.Function):
    """Send to the next rank of the ring, receive from the previous; gradients travel the other way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shift(x, group, +1)

    @staticmethod
    def backward(ctx, grad):
        return _shift(grad, ctx.group, -1), None


def _shift(x: torch.Tensor, group, step: int) -> torch.Tensor:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to, frm = (dist.get_global_rank(group, (rank + d) % size) for d in (step, -step))
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), to, group), dist.P2POp(dist.irecv, received, frm, group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


class _Broadcast(torch.autograd.Function):
    """Forward: rank `src`'s tensor on every rank of the group; backward: the gradients summed onto src."""

    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        out = x.detach().clone().contiguous()
        dist.broadcast(out, dist.get_global_rank(group, src), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone().contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return (grad if dist.get_rank(ctx.group) == ctx.src else torch.zeros_like(grad)), None, None


class _CarriedState:
    """The cache interface a Gated DeltaNet mixer reads its initial conv inputs and rule state from and writes its
    final ones to (speedllm.models.kv_cache), for one chunk."""

    def __init__(self, conv_BCW, state_BHKV):
        self.conv, self.state = conv_BCW, state_BHKV

    def linear_state(self, layer_id):
        return self.conv, self.state

    def set_linear_state(self, layer_id, conv_BCW, state_BHKV):
        self.conv, self.state = conv_BCW, state_BHKV


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum over the cp ranks; backward: each rank's gradient of its own part."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _heads_to_sequence(x_BLND, group, n: int):
    """[B, L, N, D] (this rank's positions, all heads) -> [B, n*L, N/n, D] (n ranks' positions in rank order,
    this rank's share of the heads)."""
    B, L, N, D = x_BLND.shape
    parts = x_BLND.reshape(B, L, n, N // n, D).permute(2, 0, 1, 3, 4).contiguous()
    y = all_to_all_single_autograd(parts, None, None, group)
    return y.permute(1, 0, 2, 3, 4).reshape(B, n * L, N // n, D)


def _sequence_to_heads(x_BSND, group, n: int):
    """The inverse of _heads_to_sequence."""
    B, S, Nl, D = x_BSND.shape
    parts = x_BSND.reshape(B, n, S // n, Nl, D).transpose(0, 1).contiguous()
    y = all_to_all_single_autograd(parts, None, None, group)
    return y.permute(1, 2, 0, 3, 4).reshape(B, S // n, n * Nl, D)


def _repeat_kv(k_BLKD, n: int):
    """Repeat kv heads (GQA) until their number divides by n, keeping each query head's kv head."""
    K = k_BLKD.shape[2]
    repeat = n // math.gcd(K, n)
    return k_BLKD.repeat_interleave(repeat, dim=2) if repeat > 1 else k_BLKD


def _allowed(q_idx, k_idx, docs_BS):
    """Bool [B or 1, 1, Lq, Lk]: causal by sequence position, and within one document when packed."""
    mask = (k_idx[None, :] <= q_idx[:, None])[None, None]
    if docs_BS is not None:
        mask = mask & (docs_BS[:, q_idx][:, None, :, None] == docs_BS[:, k_idx][:, None, None, :])
    return mask


def _block_attention(q_BLHD, k_BTKD, v_BTKD, mask, scale):
    """Partial attention of queries over one block of keys: (out [B, H, L, D] fp32, lse [B, H, L] fp32).

    A masked score is the lowest finite float rather than -inf, so a query that sees nothing in this block
    gets a finite lse that the merge weighs by exp(-huge) = 0, with finite gradients.
    """
    groups = q_BLHD.shape[2] // k_BTKD.shape[2]
    q = q_BLHD.transpose(1, 2).float()
    k = k_BTKD.transpose(1, 2).repeat_interleave(groups, dim=1).float()
    v = v_BTKD.transpose(1, 2).repeat_interleave(groups, dim=1).float()
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def _ring_attention(q_BLHD, k_BLKD, v_BLKD, scale, q_idx, block_idx, docs_BS, group):
    """Causal attention of this rank's queries over the keys of every rank of `group`, one block at a time.

    Args:
        q_idx: sequence positions of this rank's L queries (and keys).
        block_idx: [ranks, L] sequence positions of each ring rank's keys.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    kv = torch.stack([k_BLKD, v_BLKD])
    outs, lses = [], []
    for step in range(size):
        k_idx = block_idx[(rank - step) % size]
        # recomputed in backward, RING_QUERY_CHUNK queries at a time: no [L, L] scores outlive a chunk
        mask = _allowed(q_idx, k_idx, docs_BS)
        parts = [checkpoint(_block_attention, q_BLHD[:, i:i + RING_QUERY_CHUNK], kv[0], kv[1],
                            mask[..., i:i + RING_QUERY_CHUNK, :], scale, use_reentrant=False)
                 for i in range(0, q_BLHD.shape[1], RING_QUERY_CHUNK)]
        out, lse = torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=2)
        outs.append(out)
        lses.append(lse)
        if step < size - 1:
            kv = _RingShift.apply(kv, group)
    lse_all = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(lse - lse_all)[..., None] * o for o, lse in zip(outs, lses))
    return out.to(q_BLHD.dtype).transpose(1, 2)


class ContextParallel:
    """Hooks a whole Qwen3 for context parallelism over `cp_mesh` (see the module docstring)."""

    def __init__(self, cp_mesh: DeviceMesh, mode: str, ulysses: int, ops):
        self.group, self.rank, self.size = cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size()
        self.mode, self.ops, self.ulysses = mode, ops, ulysses
        self.ulysses_group = self.ring_group = None
        if mode == "hybrid":
            split = cp_mesh._unflatten(0, (self.size // self.ulysses, self.ulysses), ("cp_ring", "cp_ulysses"))
            self.ring_group, self.ulysses_group = split["cp_ring"].get_group(), split["cp_ulysses"].get_group()
        elif mode == "ring":
            self.ring_group = self.group
        elif mode == "ulysses":
            self.ulysses_group = self.group

    def shard_inputs(self, module, args, kwargs):
        """Forward pre-hook: keep this rank's chunks of tokens, labels and positions; pass `attend`."""
        tokens = args[0] if args else kwargs.pop("tokens")
        if kwargs.get("labels") is None:  # logits for generation: whole sequences, plain attention
            return (tokens, *args[1:]), kwargs
        B, S = tokens.shape[:2]
        order = torch.cat([local_positions(S, r, self.size) for r in range(self.size)]).to(tokens.device)
        mine = order.view(self.size, -1)[self.rank]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(S, device=tokens.device).expand(B, S)
        kwargs["labels"] = kwargs["labels"][:, mine]
        kwargs["position_ids"] = positions[:, mine]
        docs_BS = kwargs.pop("document_ids", None)
        kwargs["attend"] = self.attention(order, docs_BS)
        kwargs["linear_mix"] = partial(self.linear_mix, docs_BS=docs_BS)
        kwargs["reduce_moe_stats"] = partial(_SumOverRanks.apply, group=self.group)
        return (tokens[:, mine], *args[1:]), kwargs

    def sum_loss(self, module, args, kwargs, output):
        """Forward hook: the whole sequences' loss on every cp rank."""
        if kwargs.get("labels") is None:
            return output
        ce_sum, aux = output
        return _SumOverRanks.apply(ce_sum, self.group), aux

    def linear_mix(self, mixer, x_BLD, kv_cache, token_mask, document_ids, cu_seqlens, docs_BS):
        """A Gated DeltaNet mixer over this rank's two chunks, the state carried in sequence order (module
        docstring); with packed documents (`docs_BS`, the whole sequences') a chunk starting a new document
        starts from a zero state, and the conv's past inputs of another document are zeroed."""
        B, L, _ = x_BLD.shape
        n = L // 2
        chunks, outs = x_BLD.split(n, dim=1), [None, None]
        channels, width = mixer.conv1d.weight.shape[0], mixer.conv1d.weight.shape[-1]
        conv = x_BLD.new_zeros(B, channels, width - 1)
        state = x_BLD.new_zeros(B, mixer.num_v_heads, mixer.k_dim, mixer.v_dim, dtype=torch.float32)
        if torch.is_grad_enabled():  # every rank's broadcasts are then graph nodes, so every rank runs their backward
            conv, state = conv.requires_grad_(), state.requires_grad_()
        for c in range(2 * self.size):
            holder, part = (c, 0) if c < self.size else (2 * self.size - 1 - c, 1)
            if holder == self.rank:
                documents = (None, None)
                if docs_BS is not None:
                    docs = docs_BS[:, c * n:(c + 1) * n]
                    documents = (docs, document_bounds(docs)[0])
                    if c > 0:
                        past = docs_BS[:, c * n - width + 1:c * n] == docs[:, :1]
                        conv = conv * past[:, None].to(conv.dtype)
                        state = state * past[:, -1, None, None, None]
                carried = _CarriedState(conv, state)
                outs[part] = mixer(chunks[part], carried, token_mask, *documents)
                conv, state = carried.conv, carried.state
            if c < 2 * self.size - 1:
                conv, state = (_Broadcast.apply(t, holder, self.group) for t in (conv, state))
        # ties the chain's end into the output on every rank, so every rank runs every broadcast's backward
        return torch.cat(outs, dim=1) + 0 * (conv.sum() + state.sum()).to(x_BLD.dtype)

    def attention(self, order, docs_BS):
        """`attend` for one sharded forward; `order` holds the sequence positions of all ranks, rank by rank."""
        by_rank = order.view(self.size, -1)
        q_idx = by_rank[self.rank]
        if self.mode == "allgather":
            dense = masked_attention(self.ops.attention, _allowed(q_idx, order, docs_BS))

            def attend(q, k, v, scale):
                return dense(q, _GatherSequence.apply(k, self.group), _GatherSequence.apply(v, self.group), scale)

            return attend
        if self.mode == "ulysses":
            natural = torch.argsort(order)  # rank order -> sequence order
            if docs_BS is None:
                full = masked_attention(self.ops.attention, None)
            else:
                full = varlen_attention(self.ops.varlen_attention, *document_bounds(docs_BS))

            def attend(q, k, v, scale):
                n, g = self.size, self.ulysses_group
                k, v = _repeat_kv(k, n), _repeat_kv(v, n)
                q, k, v = (_heads_to_sequence(x, g, n)[:, natural] for x in (q, k, v))
                return _sequence_to_heads(full(q, k, v, scale)[:, order], g, n)

            return attend
        # ring, hybrid: positions each ring rank holds (after the all-to-all within its ulysses group)
        n = self.ulysses
        block_idx = by_rank.reshape(self.size // n, -1)
        q_idx = block_idx[self.rank // n]

        def attend(q, k, v, scale):
            if n > 1:
                k, v = _repeat_kv(k, n), _repeat_kv(v, n)
                q, k, v = (_heads_to_sequence(x, self.ulysses_group, n) for x in (q, k, v))
            out = _ring_attention(q, k, v, scale, q_idx, block_idx, docs_BS, self.ring_group)
            return _sequence_to_heads(out, self.ulysses_group, n) if n > 1 else out

        return attend


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, mode: str, ulysses: int) -> None:
    """Make `model` (a whole Qwen3) context-parallel over `cp_mesh`: hooks on the model pass every sharded
    forward its inputs, an `attend` function and the MoE statistics' sum; no module is changed.

    Args:
        mode: parallel.cp_mode; ulysses: ranks per all-to-all group (speedllm.parallel.rules.ulysses_degree).
    """
    cp = ContextParallel(cp_mesh, mode, ulysses, model.ops)
    model.register_forward_pre_hook(cp.shard_inputs, with_kwargs=True)
    model.register_forward_hook(cp.sum_loss, with_kwargs=True)
