"""The device mesh: one named axis per parallel dimension, shared by everything that places tensors."""

from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Outermost to innermost: pipeline stages talk least, tensor-parallel peers most (keep them on one node).
AXES = ("pp", "dp", "cp", "tp")


def build_mesh(cfg: DictConfig, device_type: str) -> DeviceMesh:
    """A 4-D mesh (pp, dp, cp, tp); axes of size 1 are kept so every rank has every coordinate."""
    p = cfg.parallel
    return init_device_mesh(device_type, (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=AXES)


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dp x cp ranks as one 1-D mesh: they hold the same parameters and see different tokens."""
    return mesh["dp", "cp"]._flatten("dp_cp")


def expert_meshes(mesh: DeviceMesh, ep: int) -> tuple:
    """(ep mesh, edp mesh): expert parallelism carved out of dp x cp, as consecutive blocks of `ep` ranks.

    Experts are split over the ep axis; ranks at the same ep coordinate hold the same experts and shard
    them further with FSDP over the edp axis.
    """
    dp_cp = data_mesh(mesh)
    split = dp_cp._unflatten(0, (dp_cp.size() // ep, ep), ("edp", "ep"))
    return split["ep"], split["edp"]
