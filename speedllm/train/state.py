"""What a training run resumes from: RNG states, the checkpoint to load, and restoring model, optimizer,
scheduler, loader position and RNG from it (or the first weights: HF, or the frozen base of an adapter run)."""

import os
import random

import numpy as np
import torch

from speedllm.checkpoint.dcp import (
    DAMAGED_FIX,
    load_checkpoint,
    load_weights,
    resolve_load,
    saved_task,
    started_from,
)
from speedllm.checkpoint.hf import load_hf_weights
from speedllm.errors import reading
from speedllm.parallel import ParallelModel
from speedllm.runtime import Runtime
from speedllm.train.optimizer import check_resumable
from speedllm.train.schedule import load_scheduler_state


def rng_state(device: torch.device) -> dict:
    """Every RNG's state as tensors and plain Python values, so checkpoints load with weights_only=True."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    cached), "torch": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = getattr(torch, device.type).get_rng_state(device)
    return state



def set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "device" in state:
        getattr(torch, device.type).set_rng_state(state["device"], device)



def load_request(cfg):
    """checkpoint.load, or `auto` when the elastic agent restarted this job after a failure."""
    if cfg.checkpoint.load is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return "auto"
    return cfg.checkpoint.load



def extra_state(step: int, scheduler, loader, device: torch.device) -> dict:
    """What a checkpoint holds beside the model and optimizer: what restore() reads back."""
    return {"step": step, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
            "rng": rng_state(device)}


def first_weights(cfg):
    """The checkpoint of another task whose weights this run started from (checkpoint.dcp.started_from), or None."""
    path = resolve_load(load_request(cfg), cfg.checkpoint.dir)
    return None if path is None else started_from(path, cfg.task.name)


def restore(cfg, rt: Runtime, pm: ParallelModel, optimizer, scheduler, loader) -> tuple:
    """Load what the run starts from: a checkpoint of this task to resume (model, optimizer, scheduler, loader
    position, RNG), another task's checkpoint (its weights only: a new run), else HF weights (checkpoint.load_hf);
    under adapters the frozen base first. Returns (step, checkpoint resumed | None)."""
    step, ck = 0, cfg.checkpoint
    resume_from = resolve_load(load_request(cfg), ck.dir)
    other = None
    if resume_from is not None:
        other = saved_task(resume_from)
        other = None if other in (None, cfg.task.name) else other
        ck.load = str(resume_from)  # the checkpoints this run saves name the one it loaded (first_weights)
    if cfg.finetune.name != "full":  # the frozen base under the adapters; the adapters resume below
        from speedllm.checkpoint.adapters import load_base

        resume_from = load_base(pm.parts, cfg, resume_from)
    if resume_from is not None and other is not None:
        load_weights(resume_from, pm.module)
    elif resume_from is not None:
        check_resumable(resume_from, cfg.optim)
        extra = load_checkpoint(resume_from, pm.module, optimizer)
        with reading(f"checkpoint.load: {resume_from}/extra_rank*.pt", DAMAGED_FIX):  # edited or garbled values
            step = int(extra["step"])
            load_scheduler_state(scheduler, optimizer, extra["scheduler"])
            loader.load_state_dict(extra["loader"])
            set_rng_state(extra["rng"], rt.device)
        if rt.is_main:
            print(f"resumed from {resume_from} at step {step}")
    elif ck.load_hf is not None and cfg.finetune.name == "full":  # fine-tune from HF weights (a resume first)
        load_hf_weights(pm.parts, ck.load_hf)
    if other is not None and rt.is_main:
        print(f"checkpoint.load: {ck.load} is a task={other} checkpoint; task={cfg.task.name} starts a new run from "
              "its weights (fresh optimizer, LR schedule and data order, step 0)")
    return step, None if other is not None else resume_from
