"""Expert parallelism: each rank of the ep axis holds E/ep experts; tokens travel to them by all-to-all.

The router and the rest of the MoE block stay as in speedllm.models.moe: it sorts its (token, expert) rows by
expert and calls `experts(rows, counts_E, ops)`. Under EP the experts module sends each rank the rows of its
experts (rows are sorted by expert and a rank's experts are consecutive, so each destination's rows are one
contiguous block), runs its local experts as one grouped matmul, and sends the results back in the original
order. Expert weights are DTensors sharded on the expert dim over the ep mesh, so checkpoints stay whole.

Letters: N rows, D features, E experts (El: this rank's experts), R ep ranks.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from speedllm.models.moe import Experts, MoE, swiglu_experts


class _AllToAll(torch.autograd.Function):
    """Rows to other ranks (`send_splits` rows each), rows from them (`recv_splits`); backward goes back."""

    @staticmethod
    def forward(ctx, x_ND, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        out = x_ND.new_empty((sum(recv_splits), *x_ND.shape[1:]))
        dist.all_to_all_single(out, x_ND.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        recv_splits, send_splits = ctx.splits
        grad = grad_out.new_empty((sum(send_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad, grad_out.contiguous(), send_splits, recv_splits, group=ctx.group)
        return grad, None, None, None


def all_to_all(x_ND, recv_splits, send_splits, group):
    return _AllToAll.apply(x_ND, recv_splits, send_splits, group)


class ExpertParallelExperts(nn.Module):
    """The experts of one MoE layer with weights sharded over an ep mesh (DTensors, Shard(0) on the expert dim);
    forward dispatches rows to their experts' ranks. Same parameter names as speedllm.models.moe.Experts."""

    def __init__(self, experts: Experts, ep_mesh: DeviceMesh):
        super().__init__()
        self.ep_mesh = ep_mesh
        for name, param in experts.named_parameters():
            self.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
        self.adapter = None  # as Experts.adapter; its weights are sharded on the expert dim like these

    def forward(self, x_ND: torch.Tensor, counts_E: torch.Tensor, ops) -> torch.Tensor:
        group = self.ep_mesh.get_group()
        num_ranks = self.ep_mesh.size()
        # counts_recv[r, e]: rows rank r sends to this rank's local expert e
        counts_recv = torch.empty_like(counts_E)
        dist.all_to_all_single(counts_recv, counts_E, group=group)
        counts_recv_RE = counts_recv.view(num_ranks, -1)
        send_splits = counts_E.view(num_ranks, -1).sum(dim=1).tolist()
        recv_splits = counts_recv_RE.sum(dim=1).tolist()
        x_recv = all_to_all(x_ND, recv_splits, send_splits, group)

        # Received rows are grouped by (source rank, local expert): regroup them by local expert.
        num_local = counts_recv_RE.shape[1]
        expert_of_row = torch.arange(num_local, device=x_ND.device).repeat(num_ranks).repeat_interleave(
            counts_recv_RE.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        counts_local = counts_recv_RE.sum(dim=0)
        gate, up, down = (w.to_local() for w in (self.gate_proj, self.up_proj, self.down_proj))
        y_sorted = swiglu_experts(x_recv[order], counts_local, ops, gate, up, down, self.adapter)
        y_recv = y_sorted[torch.argsort(order)]
        return all_to_all(y_recv, send_splits, recv_splits, group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard the experts of every MoE layer of `model` (on the meta device) over `ep_mesh`, in place."""
    for layer in model.layers.values():
        if isinstance(layer.mlp, MoE):
            layer.mlp.register_module("experts", ExpertParallelExperts(layer.mlp.experts, ep_mesh))
