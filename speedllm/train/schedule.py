"""Learning-rate schedules as a multiplier of the peak lr: warmup, then constant | linear | cosine | wsd.

`step` counts finished optimizer steps (0 before the first update), so the first update uses
lr * 1/warmup_steps and the last update of a decaying schedule lands on min_lr.
"""

import math

import torch
from omegaconf import DictConfig


SCHEDULES = ("constant", "linear", "cosine", "wsd")


def lr_factor(step: int, optim: DictConfig, total_steps: int) -> float:
    """lr(step) / optim.lr for the update that follows `step` finished steps."""
    n = step + 1  # 1-based index of the update this lr is used for
    warmup = optim.warmup_steps
    if n <= warmup:
        return n / warmup
    if optim.schedule == "constant":
        return 1.0
    floor = optim.min_lr / optim.lr
    if optim.schedule == "wsd":
        # warmup-stable-decay: hold the peak, then decay linearly over the last decay_fraction of the run
        decay_steps = max(1, round(optim.decay_fraction * total_steps))
        decay_start = max(warmup, total_steps - decay_steps)
        if n <= decay_start:
            return 1.0
        progress = (n - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - floor) * min(1.0, progress)
    progress = min(1.0, (n - warmup) / max(1, total_steps - warmup))
    if optim.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, optim: DictConfig, total_steps: int):
    """A LambdaLR over `lr_factor`; its state (last_epoch) is saved with checkpoints."""
    lr_factor(0, optim, total_steps)  # validate the schedule name before the run starts
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim, total_steps))


def load_scheduler_state(scheduler, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Resume `scheduler` at the saved step count. Its per-group lists stay this optimizer's: the saving layout
    may have grouped the parameters differently (expert parallelism adds a group per mesh, a pipeline rank
    groups only its stages'); the learning rates come back with the optimizer's loaded groups."""
    scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": saved["last_epoch"],
                               "_step_count": saved["_step_count"],
                               "_last_lr": [group["lr"] for group in optimizer.param_groups]})
