"""Context parallelism: each rank of the cp axis holds part of every sequence; attention all-gathers K/V.

Load balancing for causal attention: a sequence of S tokens is cut into 2*cp chunks and rank r keeps chunks
r and 2*cp-1-r, so every rank has as many early (cheap) as late (expensive) query positions. A forward
pre-hook on the model cuts tokens and labels and passes the chunks' true positions as position_ids (RoPE);
each attention layer gathers the keys and values of the whole sequence from the cp ranks and masks by
position. The model's loss is summed over the cp ranks, so every cp rank returns the whole sequence's loss,
while each rank's gradient stays its own share (the data-parallel reduction over dp x cp sums them).

Letters: B batch, S sequence (Sl: this rank's part), H/K query/kv heads, Dh head dim, T keys.
"""

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from speedllm.errors import UserError


def local_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """Sequence positions held by `cp_rank`: chunks cp_rank and 2*cp-1-cp_rank of 2*cp."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


class _GatherSequence(torch.autograd.Function):
    """All-gather [B, K, Sl, Dh] along the sequence in rank order; backward sums the gradients and keeps ours."""

    @staticmethod
    def forward(ctx, x_BKSD, group):
        ctx.group = group
        parts = [torch.empty_like(x_BKSD) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_BKSD.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad_BKTD):
        grad = grad_BKTD.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad.chunk(dist.get_world_size(ctx.group), dim=2)[dist.get_rank(ctx.group)], None


class _SumLoss(torch.autograd.Function):
    """Forward: the loss summed over the cp ranks; backward: each rank's gradient of its own part."""

    @staticmethod
    def forward(ctx, loss, group):
        total = loss.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ContextParallel:
    """Hooks a whole Qwen3 for context parallelism over `cp_mesh` (see the module docstring)."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.group = cp_mesh.get_group()
        self.rank, self.size = cp_mesh.get_local_rank(), cp_mesh.size()
        self.key_positions = None  # positions of the gathered keys while a sharded forward runs

    def shard_inputs(self, module, args, kwargs):
        """Forward pre-hook: keep this rank's chunks of tokens and labels; positions become position_ids."""
        tokens = args[0] if args else kwargs.pop("tokens")
        if kwargs.get("labels") is None:  # logits for generation: whole sequences, plain attention
            self.key_positions = None
            return (tokens, *args[1:]), kwargs
        if kwargs.get("document_ids") is not None or kwargs.get("position_ids") is not None:
            raise UserError("parallel.cp > 1 does not support packed sequences (data.packing=true); "
                            "set data.packing=false or parallel.cp=1")
        seq_len = tokens.shape[1]
        mine = local_positions(seq_len, self.rank, self.size).to(tokens.device)
        self.key_positions = torch.cat([local_positions(seq_len, r, self.size) for r in range(self.size)]).to(
            tokens.device)
        kwargs["labels"] = kwargs["labels"][:, mine]
        kwargs["position_ids"] = mine.expand(tokens.shape[0], -1)
        return (tokens[:, mine], *args[1:]), kwargs

    def sum_loss(self, module, args, kwargs, output):
        """Forward hook: the whole sequences' loss on every cp rank."""
        if self.key_positions is None:
            return output
        ce_sum, aux = output
        return _SumLoss.apply(ce_sum, self.group), aux

    def attention(self, dense_attention):
        """The op set's attention, with keys and values gathered over the cp ranks during sharded forwards."""

        def cp_attention(q_BHSD, k_BKSD, v_BKSD, mask, scale):
            if self.key_positions is None:
                return dense_attention(q_BHSD, k_BKSD, v_BKSD, mask, scale)
            k_BKTD = _GatherSequence.apply(k_BKSD, self.group)
            v_BKTD = _GatherSequence.apply(v_BKSD, self.group)
            q_pos = self.key_positions.view(self.size, -1)[self.rank]
            causal_ST = self.key_positions[None, :] <= q_pos[:, None]
            B, _, S, _ = q_BHSD.shape
            return dense_attention(q_BHSD, k_BKTD, v_BKTD, causal_ST.expand(B, 1, S, -1), scale)

        return cp_attention


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Make `model` (a whole Qwen3, on the meta device) context-parallel over `cp_mesh`, in place."""
    cp = ContextParallel(cp_mesh)
    model.register_forward_pre_hook(cp.shard_inputs, with_kwargs=True)
    model.register_forward_hook(cp.sum_loss, with_kwargs=True)
    for layer in model.layers.values():
        attn = layer.self_attn
        attn.ops = dataclasses.replace(attn.ops, attention=cp.attention(attn.ops.attention))
