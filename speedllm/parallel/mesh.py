"""The device mesh: one named axis per parallel dimension, shared by everything that places tensors."""

from dataclasses import dataclass
from typing import Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Outermost to innermost: pipeline stages talk least, tensor-parallel peers most (keep them on one node).
AXES = ("pp", "dp", "cp", "tp")


def build_mesh(parallel, device_type: str) -> DeviceMesh:
    """A 4-D mesh (pp, dp, cp, tp); axes of size 1 are kept so every rank has every coordinate."""
    p = parallel
    return init_device_mesh(device_type, (p.pp, p.dp, p.cp, p.tp), mesh_dim_names=AXES)


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of this job's layout, read from its mesh (the one source of truth inside a worker).

    Without a mesh (a single process) every degree is 1. Expert parallelism is not a mesh axis: it is
    carved out of dp x cp x tp (see `expert_meshes`), so its degree is carried alongside.
    """

    mesh: Optional[DeviceMesh] = None
    ep: int = 1

    def size(self, axis: str) -> int:
        return self.mesh[axis].size() if self.mesh is not None else 1

    @property
    def dp(self) -> int:
        return self.size("dp")

    @property
    def tp(self) -> int:
        return self.size("tp")

    @property
    def pp(self) -> int:
        return self.size("pp")

    @property
    def cp(self) -> int:
        return self.size("cp")

    def coords(self, axis: str) -> tuple:
        """(rank on `axis`, its size, its process group or None)."""
        if self.mesh is None:
            return 0, 1, None
        sub = self.mesh[axis]
        return sub.get_local_rank(), sub.size(), sub.get_group()

    def data_mesh(self) -> DeviceMesh:
        """The dp x cp ranks as one 1-D mesh: they hold the same parameters and see different tokens."""
        return self.mesh["dp", "cp"]._flatten("dp_cp")

    def expert_meshes(self) -> tuple:
        """(ep mesh, edp mesh): expert parallelism carved out of dp x cp x tp, as consecutive blocks of `ep`
        ranks (tp innermost, so an ep group spans the tp peers first).

        These ranks all route different tokens through the experts (tp ranks too: with sequence parallel each
        holds its own share of the sequence). Experts are split over the ep axis; ranks at the same ep
        coordinate hold the same experts and shard them further with FSDP over the edp axis.
        """
        tokens = self.mesh["dp", "cp", "tp"]._flatten("dp_cp_tp")
        split = tokens._unflatten(0, (tokens.size() // self.ep, self.ep), ("edp", "ep"))
        return split["ep"], split["edp"]
