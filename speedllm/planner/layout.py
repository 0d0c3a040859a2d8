"""A candidate layout: parallel degrees plus the training knobs the planner searches (micro batch, recompute)."""

from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class Layout:
    """One way to place a training run on `world` devices (world = dp * cp * tp * pp)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    cp: int = 1
    cp_mode: str = "allgather"  # allgather | ring | ulysses | hybrid
    micro_batch: int = 1
    recompute: str = "none"  # none | selective | full
    fsdp: bool = True
    reshard_after_forward: bool = True
    sequence_parallel: bool = True
    schedule: str = "1F1B"
    offload: str = "none"  # parallel.offload: none | optimizer | params
    activation_offload: bool = False  # train.activation_offload

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def short(self) -> str:
        """`tp2 pp4 vpp2 dp8 ep4 cp1 mb1 full` style name for tables."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        parts.append(f"dp{self.dp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}-{self.cp_mode}")
        parts += [f"mb{self.micro_batch}", self.recompute]
        if not self.fsdp and self.dp > 1:
            parts.append("ddp")
        if self.offload != "none":
            parts.append(f"offload-{self.offload}")
        if self.activation_offload:
            parts.append("act-offload")
        return " ".join(parts)


def layout_from_config(parallel, train) -> Layout:
    """The Layout a resolved config describes (parallel.dp must already be >= 1)."""
    return Layout(dp=parallel.dp, tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp, ep=parallel.ep, cp=parallel.cp,
                  cp_mode=parallel.cp_mode, micro_batch=train.micro_batch_size, recompute=train.recompute,
                  fsdp=parallel.fsdp, reshard_after_forward=parallel.reshard_after_forward,
                  sequence_parallel=parallel.sequence_parallel, schedule=parallel.pp_schedule,
                  offload=parallel.offload, activation_offload=train.activation_offload)


def apply_layout(layout: Layout, parallel, train=None, pp_layers=None) -> None:
    """Write every field of `layout` into a config's parallel section (and, for training, its train section): the
    inverse of layout_from_config, so the run builds the layout the planner costed. `pp_layers`: the stage sizes
    when they are not even (parallel.pp_layers), else None."""
    parallel.dp, parallel.tp, parallel.pp, parallel.vpp = layout.dp, layout.tp, layout.pp, layout.vpp
    parallel.ep, parallel.cp, parallel.cp_mode = layout.ep, layout.cp, layout.cp_mode
    parallel.fsdp, parallel.reshard_after_forward = layout.fsdp, layout.reshard_after_forward
    parallel.sequence_parallel, parallel.pp_schedule = layout.sequence_parallel, layout.schedule
    parallel.offload, parallel.pp_layers = layout.offload, pp_layers
    if train is not None:
        train.micro_batch_size, train.recompute = layout.micro_batch, layout.recompute
        train.activation_offload = layout.activation_offload


def uneven(split: List[int]):
    """parallel.pp_layers for a stage split: the list when its stages differ in size, else None (an even split)."""
    return split if len(set(split)) > 1 else None

