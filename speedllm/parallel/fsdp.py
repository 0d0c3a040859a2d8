"""FSDP2 (`fully_shard`) over the data-parallel ranks, composed with TP (2-D), EP and pipeline stages.

Parameters are sharded over dp x cp: context-parallel ranks see different tokens of the same sequences, so
their gradients are summed exactly like data-parallel ones. `parallel.fsdp=false` replicates over dp instead
(HSDP with a replicate axis of size dp: DDP-like) and still shards over cp.

`parallel.offload=params` hands every unit FSDP2's CPUOffloadPolicy: the sharded fp32 parameters, their
gradients and so the optimizer states and update live in host memory; each unit's shards are copied to the device
before its all-gather and its reduced gradients back after the reduce-scatter. Pinned on accelerators (the copies
overlap compute); on a CPU device the host is the device, nothing is pinned and the copies are no-ops, but the
policy's code path (host shards, gradient hand-off, the update on host tensors) runs the same.
"""

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from speedllm.parallel.mesh import ParallelDims


def apply_fsdp(model: nn.Module, dims: ParallelDims, param_dtype: torch.dtype, shard: bool, reshard: bool,
               expert_mesh: DeviceMesh = None, offload_params: bool = False) -> None:
    """fully_shard every decoder layer and the root (one pipeline stage or the whole model).

    Args:
        param_dtype: compute dtype of the parameters (gradient reductions and master weights stay fp32).
        shard: shard over dp x cp (FSDP); False replicates over dp (HSDP with a dp replicate axis).
        reshard: free gathered parameters after forward (ZeRO-3-like) rather than keep them (ZeRO-2-like).
        expert_mesh: with expert parallelism (or a MoE model under tensor parallelism), the mesh to shard the
            experts over (the dp x cp x tp ranks holding the same experts); the experts become their own FSDP unit.
        offload_params: sharded parameters, gradients and optimizer states in host memory (parallel.offload=params).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = offload_policy(offload_params, dims.mesh.device_type)
    shard_mesh = dims.data_mesh() if shard else dims.mesh["dp", "cp"]
    for layer in model.layers.values():
        if expert_mesh is not None and layer.is_moe:
            experts = layer.mlp.experts
            dim = expert_shard_dim(experts.gate_proj.shape[0] // dims.ep, expert_mesh.size())
            fully_shard(experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard,
                        shard_placement_fn=lambda param, dim=dim: Shard(dim), offload_policy=offload)
        fully_shard(layer, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    fully_shard(model, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=reshard, offload_policy=offload)
    # The loop divides each rank's loss by the global token count, so ranks' gradients must be summed.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # a plain SUM: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway
            module.set_force_sum_reduction_for_comms(True)


def offload_policy(offload_params: bool, device_type: str) -> OffloadPolicy:
    """FSDP2's CPUOffloadPolicy for parallel.offload=params (pinned host memory where there is a device to copy
    to: pinning needs an accelerator), else no offload."""
    if not offload_params:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


def expert_shard_dim(local_experts: int, shards: int) -> int:
    """The dim FSDP2 shards a rank's stacked experts [E, out, in] on over `shards` ranks: the expert dim, unless
    the rank has fewer experts than shards (chunking them would leave ranks without any while others hold
    whole experts, e.g. 16 experts over 32 ranks at 235B FSDP256 x EP8): then each expert's output rows."""
    return 0 if local_experts >= shards else 1
