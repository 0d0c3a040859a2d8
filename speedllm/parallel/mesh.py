"""The device mesh: one named axis per parallel dimension, shared by everything that places tensors."""

from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Outermost to innermost: pipeline stages talk least, tensor-parallel peers most (keep them on one node).
AXES = ("pp", "dp", "cp", "tp")


def world_size_of(parallel: DictConfig) -> int:
    """World size implied by the layout (dp must already be resolved, i.e. >= 1)."""
    return parallel.pp * parallel.dp * parallel.cp * parallel.tp


def build_mesh(cfg: DictConfig, device_type: str) -> DeviceMesh:
    """A 4-D mesh (pp, dp, cp, tp); axes of size 1 are kept so every rank has every coordinate."""
    p = cfg.parallel
    return init_device_mesh(device_type, (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=AXES)
