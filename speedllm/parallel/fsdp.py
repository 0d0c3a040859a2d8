"""FSDP2 (`fully_shard`) over the data-parallel ranks, composed with TP (2-D), EP and pipeline stages.

Parameters are sharded over dp x cp: context-parallel ranks see different tokens of the same sequences, so
their gradients are summed exactly like data-parallel ones. `parallel.fsdp=false` replicates over dp instead
(HSDP with a replicate axis of size dp: DDP-like) and still shards over cp.
"""

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from speedllm.hardware import DTYPES
from speedllm.parallel.mesh import data_mesh


def mixed_precision(cfg: DictConfig) -> MixedPrecisionPolicy:
    """The hardware profile's compute dtype for parameters, fp32 for gradient reductions (and master weights)."""
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.hardware.dtype], reduce_dtype=torch.float32)


def fsdp_mesh(cfg: DictConfig, mesh: DeviceMesh) -> DeviceMesh:
    """1-D (dp*cp) mesh to shard over, or the 2-D (dp, cp) mesh for HSDP when parallel.fsdp is false."""
    return data_mesh(mesh) if cfg.parallel.fsdp else mesh["dp", "cp"]


def apply_fsdp(model: nn.Module, cfg: DictConfig, mesh: DeviceMesh, expert_mesh: DeviceMesh = None) -> None:
    """fully_shard every decoder layer and the root (one pipeline stage or the whole model).

    Args:
        mesh: the world mesh (speedllm.parallel.mesh.build_mesh).
        expert_mesh: with expert parallelism, the mesh to shard the experts over (the data ranks holding the
            same experts); the experts become their own FSDP unit.
    """
    mp = mixed_precision(cfg)
    shard_mesh = fsdp_mesh(cfg, mesh)
    reshard = cfg.parallel.reshard_after_forward
    for layer in model.layers.values():
        if expert_mesh is not None and layer.is_moe:
            fully_shard(layer.mlp.experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(layer, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=shard_mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The loop divides each rank's loss by the global token count, so ranks' gradients must be summed.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # a plain SUM: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway
            module.set_force_sum_reduction_for_comms(True)
