"""What a training task builds: the parallelized model on this rank, its optimizer, schedule, loader and
autocast, restored from where the run starts (build_training); the micro-batch count.

Shared by task=pretrain/sft, task=dpo, task=dryrun and the planner's measurements.
"""

import contextlib
from pathlib import Path
from typing import Any, Dict, NamedTuple, Optional

import torch

from speedllm.adapters.lora import adapter_fn, init_adapters
from speedllm.checkpoint.dcp import Checkpointer, load_weights
from speedllm.checkpoint.hf import load_hf_weights
from speedllm.hardware import DTYPES
from speedllm.models.moe import take_expert_load
from speedllm.parallel import ParallelModel, materialize, output_loss_for, parallelize
from speedllm.parallel.offload import states_to_host
from speedllm.runtime import Runtime, seed_everything
from speedllm.train.metrics import MetricsLogger
from speedllm.train.optimizer import build_optimizer
from speedllm.train.schedule import build_scheduler
from speedllm.train.state import first_weights, restore


def grad_accum_steps(train, dp_size: int) -> int:
    """Micro-batches per rank per step (validation made sure they divide)."""
    return train.global_batch_size // (train.micro_batch_size * dp_size)



def meta_model(cfg, rt: Runtime, adapt=None) -> ParallelModel:
    """Qwen3 built on the meta device and parallelized for this rank: what training (and task=dryrun) builds."""
    from speedllm.models.qwen3 import Qwen3

    dims = rt.dims
    with torch.device("meta"):
        model = Qwen3(cfg.model, ops=cfg.hardware.ops, output_loss=output_loss_for(dims),
                      loss_chunk_size=cfg.train.loss_chunk_size)
    return parallelize(model, dims, cfg.parallel, cfg.train, DTYPES[cfg.hardware.dtype], rt.device, cfg.quant, adapt)


def build_model(cfg, rt: Runtime) -> ParallelModel:
    """Qwen3 built on the meta device, parallelized, then materialized and initialized on this rank's device."""
    adapt = adapter_fn(cfg.finetune)
    pm = meta_model(cfg, rt, adapt)
    materialize(pm, rt.dims, rt.device, cfg.seed, cfg.parallel.offload == "params")
    take_expert_load(pm.module)  # the expert load tallies start from zero (to_empty left them unset)
    if adapt is not None:  # the same adapters on every layout, B = 0
        init_adapters(pm.parts, cfg.seed)
    return pm



def autocast_for(cfg, pm: ParallelModel, device: torch.device):
    """bf16/fp16 compute over fp32 master weights. FSDP2 applies its own mixed-precision policy instead."""
    from torch.distributed.fsdp import FSDPModule

    dtype = DTYPES[cfg.hardware.dtype]
    if dtype == torch.float32 or isinstance(pm.module, FSDPModule):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)



def to_device(batch: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class Training(NamedTuple):
    """What a training task steps: built for this rank and restored (a resume, or the first weights)."""

    pm: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: Any
    autocast: Any
    step: int  # the step it starts after
    resume_from: Optional[Path]


def build_training(cfg, rt: Runtime, loader=None) -> Training:
    """The model, optimizer, LR schedule and train-split loader of this rank, restored by train.state.restore.

    `loader`: the task's own data source (state_dict / load_state_dict, e.g. task=grpo's prompt order) instead
    of the train-split loader."""
    from speedllm.data.loader import build_loader

    t = cfg.train
    dp_rank, dp_size, _ = rt.dims.coords("dp")
    pm = build_model(cfg, rt)
    optimizer = build_optimizer(pm.module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, t.steps)
    if loader is None:
        loader = build_loader(cfg, "train", dp_rank, dp_size, t.micro_batch_size, t.seq_len, cfg.seed)
    autocast = autocast_for(cfg, pm, rt.device)
    step, resume_from = restore(cfg, rt, pm, optimizer, scheduler, loader)
    if cfg.parallel.offload == "optimizer":  # a checkpoint's states were loaded onto the device
        states_to_host(optimizer)
    return Training(pm, optimizer, scheduler, loader, autocast, step, resume_from)


def frozen_reference(cfg, rt: Runtime) -> torch.nn.Module:
    """The starting weights, frozen (DPO's and GRPO's reference model): built under the job's layout from the
    seed and loaded as the policy was first: from another task's checkpoint (train.state.first_weights) or
    checkpoint.load_hf."""
    seed_everything(cfg.seed)
    reference = build_model(cfg, rt).module
    start = first_weights(cfg)
    if start is not None:
        load_weights(start, reference)
    elif cfg.checkpoint.load_hf is not None:
        load_hf_weights(reference, cfg.checkpoint.load_hf)
    return reference.requires_grad_(False)


class Loop(NamedTuple):
    """What a training task's loop reports to and saves through, and the step it stops after."""

    logger: MetricsLogger
    checkpointer: Checkpointer
    stop_at: int  # train.steps, or train.stop_after steps after the one it starts from


def training_loop(cfg, rt: Runtime, step: int) -> Loop:
    t, ck, log = cfg.train, cfg.checkpoint, cfg.logging
    logger = MetricsLogger(cfg.run_dir, t.steps, step, rt.is_main, log.tensorboard, log.progress_bar)
    stop_at = min(t.steps, step + t.stop_after) if t.stop_after > 0 else t.steps
    # what the run started from (restore() left checkpoint.load resolved): its checkpoints keep that release's
    # files (config, tokenizer, vision tower, MTP)
    start = ck.load if ck.load not in (None, "auto") else ck.load_hf
    release_from = start if cfg.finetune.name == "full" else None
    return Loop(logger, Checkpointer(ck.dir, ck.keep, ck.async_save, release_from), stop_at)
