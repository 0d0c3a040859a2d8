"""Auto-parallel planner: per-rank memory and step-time model, layout search (`parallel=auto`, `task=plan`)."""

import os

from omegaconf import DictConfig

from speedllm.runtime import under_torchrun


def device_count(cfg: DictConfig) -> int:
    """Devices the plan is for: torchrun's world, else nnodes x nproc_per_node (x the profile's devices per
    node when nproc_per_node is 0)."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    per_node = cfg.launcher.nproc_per_node or cfg.hardware.devices_per_node
    return cfg.launcher.nnodes * per_node
