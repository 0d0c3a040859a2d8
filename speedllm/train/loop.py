"""task=pretrain and task=sft: one loop, read top to bottom.

A step consumes global_batch_size sequences: micro_batch_size per forward on each of the dp ranks,
accumulated over global_batch_size / (micro_batch_size * dp) micro-batches. The step's loss is
    sum of token cross-entropies over the whole global batch / number of target tokens in it
    + the MoE auxiliary loss averaged over micro-batches and ranks,
exactly, whatever the split: each micro-batch's summed cross-entropy is divided by the step's global
token count (counted up front), and the data-parallel gradient reduction sums instead of averaging.
SFT is the same loop; its loader masks every label outside the assistant turns with IGNORE_INDEX.
"""

import contextlib
import math
import os
import random
import time
import warnings
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from speedllm.checkpoint.dcp import Checkpointer, latest_checkpoint, load_checkpoint, resolve_load
from speedllm.checkpoint.hf import load_hf_weights
from speedllm.finetune.lora import adapter_fn, init_adapters
from speedllm.hardware import DTYPES
from speedllm.ops import IGNORE_INDEX
from speedllm.parallel import ParallelModel, clip_grad_norm, materialize, output_loss_for, parallelize
from speedllm.parallel.offload import states_to_host, step_with_host_states
from speedllm.runtime import Runtime, seed_everything
from speedllm.train.faults import BadSteps, Preemption
from speedllm.train.metrics import MetricsLogger, flops_per_token, mfu, peak_memory_gb
from speedllm.train.optimizer import build_optimizer, check_resumable
from speedllm.train.samples import print_samples
from speedllm.train.schedule import build_scheduler, load_scheduler_state


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


def model_inputs(batch: Dict[str, torch.Tensor]) -> dict:
    """Keyword arguments of the model's forward present in a loader batch."""
    return {k: batch[k] for k in ("labels", "position_ids", "document_ids") if k in batch}


def count_targets(micro_batches: List[dict], group) -> torch.Tensor:
    """Target tokens (labels != IGNORE_INDEX) of the whole step, summed over the data-parallel ranks."""
    count = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in micro_batches).to(torch.float32)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count


def forward_backward(model: nn.Module, micro_batches: List[dict], num_targets: torch.Tensor,
                     dp_size: int, autocast) -> tuple:
    """Run forward and backward over this rank's micro-batches; return this rank's (ce_sum, aux_sum).

    Pipeline parallelism substitutes its schedule for this function (same inputs, same outputs).
    """
    from torch.distributed.fsdp import FSDPModule

    ce_total = aux_total = torch.zeros((), device=num_targets.device)
    num_micro = len(micro_batches)
    for i, mb in enumerate(micro_batches):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == num_micro - 1)  # reduce-scatter grads once per step
        with autocast:
            ce_sum, aux = model(mb["tokens"], **model_inputs(mb))
        # each rank's share of the global loss; the dp gradient reduction sums the shares
        loss = ce_sum / num_targets + aux / (num_micro * dp_size)
        loss.backward()
        ce_total = ce_total + ce_sum.detach()
        aux_total = aux_total + aux.detach()
    return ce_total, aux_total


def train_step(pm: ParallelModel, optimizer, scheduler, micro_batches, cfg, dp_size, group, autocast) -> tuple:
    """One optimizer step. Returns (loss, grad_norm, ok); a non-finite loss or gradient skips the update."""
    num_targets = count_targets(micro_batches, group)
    if pm.pipeline is not None:  # pipeline parallel runs its own schedule
        ce_sum, aux_sum = pm.pipeline.forward_backward(micro_batches, num_targets, dp_size)
    else:
        ce_sum, aux_sum = forward_backward(pm.module, micro_batches, num_targets, dp_size, autocast)
    reported = torch.stack([ce_sum, aux_sum])
    if group is not None:
        dist.all_reduce(reported, group=group)
    loss = reported[0] / num_targets + reported[1] / (len(micro_batches) * dp_size)
    grad_norm = clip_grad_norm(pm, cfg.train.grad_clip)
    ok = bool(torch.isfinite(loss) and torch.isfinite(grad_norm))
    if ok and cfg.parallel.offload == "optimizer":
        step_with_host_states(optimizer)
    elif ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # torch warns when a skipped update precedes the first scheduler step
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        scheduler.step()  # the schedule follows the step count, skipped steps included
    return loss.item(), grad_norm.item(), ok


@torch.no_grad()
def evaluate(pm: ParallelModel, cfg, dp_rank: int, dp_size: int, group, device, autocast) -> float:
    """Mean token cross-entropy over the first train.eval_steps micro-batches of the valid split."""
    from speedllm.data.loader import build_loader

    t = cfg.train
    loader = build_loader(cfg, "valid", dp_rank, dp_size, t.micro_batch_size, t.seq_len, cfg.seed)
    totals = torch.zeros(2, device=device)
    pm.eval()
    for _, batch in zip(range(t.eval_steps), loader):
        batch = to_device(batch, device)
        with autocast:
            ce_sum, _ = pm(batch["tokens"], **model_inputs(batch))
        totals += torch.stack([ce_sum.float(), (batch["labels"] != IGNORE_INDEX).sum().float()])
    pm.train()
    if group is not None:
        dist.all_reduce(totals, group=group)
    return (totals[0] / totals[1]).item()


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


def restore(cfg, rt: Runtime, pm: ParallelModel, optimizer, scheduler, loader) -> tuple:
    """Load what the run starts from: a checkpoint to resume (model, optimizer, scheduler, loader position, RNG),
    else HF weights (checkpoint.load_hf); under adapters the frozen base first. Returns (step, checkpoint | None)."""
    step, ck = 0, cfg.checkpoint
    resume_from = resolve_load(load_request(cfg), ck.dir)
    if cfg.finetune.name != "full":  # the frozen base under the adapters; the adapters resume below
        from speedllm.finetune.base import load_base

        resume_from = load_base(pm.parts, cfg, resume_from)
    if resume_from is not None:
        check_resumable(resume_from, cfg.optim)
        extra = load_checkpoint(resume_from, pm.module, optimizer)
        step = extra["step"]
        load_scheduler_state(scheduler, optimizer, extra["scheduler"])
        loader.load_state_dict(extra["loader"])
        set_rng_state(extra["rng"], rt.device)
        if rt.is_main:
            print(f"resumed from {resume_from} at step {step}")
    elif ck.load_hf is not None and cfg.finetune.name == "full":  # fine-tune from HF weights (a resume first)
        load_hf_weights(pm.parts, ck.load_hf)
    return step, resume_from


def run(cfg, rt: Runtime) -> None:
    """Train (task=pretrain) or fine-tune (task=sft) per cfg; checkpoints, metrics and samples go to the run dir."""
    from speedllm.data.loader import build_loader

    t, ck = cfg.train, cfg.checkpoint
    seed_everything(cfg.seed)
    dp_rank, dp_size, group = rt.dims.coords("dp")
    accum = grad_accum_steps(t, dp_size)
    pm = build_model(cfg, rt)
    optimizer = build_optimizer(pm.module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, t.steps)
    loader = build_loader(cfg, "train", dp_rank, dp_size, t.micro_batch_size, t.seq_len, cfg.seed)
    autocast = autocast_for(cfg, pm, rt.device)

    step, resume_from = restore(cfg, rt, pm, optimizer, scheduler, loader)
    if cfg.parallel.offload == "optimizer":  # a checkpoint's states were loaded onto the device
        states_to_host(optimizer)
    checkpointer = Checkpointer(ck.dir, ck.keep, ck.async_save)

    def checkpoint() -> None:
        extra = {"step": step, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                 "rng": rng_state(rt.device)}
        saved = checkpointer.save(step, pm.module, optimizer, extra, cfg)
        logger.message(f"checkpoint: step {step} {'saving in the background' if ck.async_save else 'saved'} to "
                       f"{saved}")

    tokens_per_step = t.global_batch_size * t.seq_len
    flops_tok = flops_per_token(cfg.model, t.seq_len)
    peak_tflops = cfg.hardware.peak_tflops[cfg.hardware.dtype]
    logger = MetricsLogger(cfg.run_dir, t.steps, step, rt.is_main, cfg.logging.tensorboard, cfg.logging.progress_bar)
    bad = BadSteps(t.max_bad_steps)
    stop_at = min(t.steps, step + t.stop_after) if t.stop_after > 0 else t.steps
    window_losses, window_time, window_steps = [], 0.0, 0
    last_saved = step if resume_from is not None else None
    try:
        with Preemption() as preemption:
            while step < stop_at:
                start = time.perf_counter()
                lr = scheduler.get_last_lr()[0]
                micro_batches = [to_device(next(loader), rt.device) for _ in range(accum)]  # endless loader
                loss, grad_norm, ok = train_step(pm, optimizer, scheduler, micro_batches, cfg, dp_size, group,
                                                 autocast)
                step += 1
                window_time += time.perf_counter() - start  # .item() above synchronized the device
                window_steps += 1
                bad.record(ok, step)
                if ok:
                    window_losses.append(loss)
                logger.advance(step)
                if step % t.log_every == 0 or step == stop_at:
                    tokens_per_s = window_steps * tokens_per_step / window_time
                    achieved = mfu(tokens_per_s, flops_tok, peak_tflops, rt.world_size)
                    logger.log(step, {
                        "loss": sum(window_losses) / len(window_losses) if window_losses else math.nan,
                        "lr": lr,
                        "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                        "tflops": tokens_per_s * flops_tok / rt.world_size / 1e12, "mfu": achieved,
                        "peak_mem_gb": peak_memory_gb(rt.device), "skipped_steps": bad.total})
                    window_losses, window_time, window_steps = [], 0.0, 0
                if t.eval_every > 0 and step % t.eval_every == 0:
                    valid_loss = evaluate(pm, cfg, dp_rank, dp_size, group, rt.device, autocast)
                    logger.log(step, {"loss": valid_loss, "ppl": math.exp(min(valid_loss, 50.0))}, prefix="valid")
                if ck.every > 0 and step % ck.every == 0 and bad.in_a_row == 0:  # never save a suspect state
                    checkpoint()
                    last_saved = step
                if preemption.any_rank(rt.device):
                    logger.message(f"SIGTERM: saving a checkpoint at step {step} and exiting")
                    break
        if last_saved != step and (ck.save_final or step < t.steps):  # stopped early: always save
            checkpoint()
        checkpointer.close()
    finally:
        logger.close()
    root = Path(ck.dir).absolute()
    if rt.is_main and latest_checkpoint(str(root)) is not None:
        print(f"checkpoint: {latest_checkpoint(str(root))}\n"
              f"  generate: python launch.py task=generate checkpoint.load={root} generate.prompt=\"ROMEO:\"\n"
              f"  resume:   the same command plus checkpoint.load={root} (raise train.steps to train further)")
    if step >= t.steps and cfg.generate.num_samples > 0:
        if pm.pipeline is None:
            print_samples(pm.module, cfg, rt.is_main)
        elif rt.is_main:
            print("samples skipped: generation does not run on pipeline stages (parallel.pp > 1)")
