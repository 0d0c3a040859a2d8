"""task=distill: a student learns a frozen teacher's next-token distributions (knowledge distillation).

Off-policy, on the sequences of `data=` (pretraining or SFT data, with their loss masks): each labelled position's
loss is a divergence between the teacher's and the student's distributions at distill.temperature (forward KL,
reverse KL or GKD's generalized JSD, speedllm.train.distill_loss), optionally mixed with the labels' cross-entropy.
The teacher (speedllm.train.teacher) is built under the student's layout and runs without gradients; its final
hidden states and output weight go into the student's output loss, which makes both models' logits one chunk of
positions at a time. Like the training loop (speedllm.train.step), each rank divides its sum by the step's global
count of labelled positions and the data-parallel gradient reduction sums, so the step is exact whatever the split.
Runs without pipeline stages and context parallelism.
"""

import math
import time
import warnings
from functools import partial
from typing import List

import torch
import torch.distributed as dist

from speedllm.checkpoint.dcp import Checkpointer
from speedllm.parallel import ParallelModel, clip_grad_norm
from speedllm.parallel.offload import optimizer_step
from speedllm.runtime import Runtime, seed_everything
from speedllm.train.build import build_training, grad_accum_steps, to_device
from speedllm.train.distill_loss import STATS, Objective, distill_loss
from speedllm.train.metrics import MetricsLogger, peak_memory_gb
from speedllm.train.state import extra_state
from speedllm.train.step import count_targets, model_inputs
from speedllm.train.teacher import build_teacher, head_weight, teacher_hidden


def objective_of(cfg) -> Objective:
    d = cfg.distill
    return Objective(d.loss, d.beta, d.temperature, d.top_k or 0, d.ce_weight)


def distill_forward(model, teacher, batch: dict, objective: Objective, stats: torch.Tensor, autocast) -> tuple:
    """(the batch's summed loss, MoE aux loss) of the student against the teacher; STATS sums added to `stats`."""
    with autocast:
        hidden = teacher_hidden(teacher, batch)
        with head_weight(teacher) as weight:
            return model(batch["tokens"], **model_inputs(batch), output_loss=partial(
                distill_loss, teacher_hidden=hidden, teacher_weight=weight, objective=objective, stats=stats))


def reduced_metrics(totals: torch.Tensor, group) -> dict:
    """distill/* of [loss sum, *STATS sums] summed over the data-parallel ranks: means per labelled position."""
    if group is not None:
        dist.all_reduce(totals, group=group)
    loss, kl, ce, agree, count = totals.tolist()
    return {"distill/loss": loss / count, "distill/kl": kl / count, "distill/ce": ce / count,
            "distill/top1_agree": agree / count}


def distill_step(pm: ParallelModel, teacher, optimizer, scheduler, micro_batches: List[dict], objective: Objective,
                 cfg, dp_size: int, group, autocast) -> dict:
    """One optimizer step over this rank's micro-batches; returns the step's metrics (all ranks)."""
    from torch.distributed.fsdp import FSDPModule

    model = pm.module
    num_micro = len(micro_batches)
    num_targets = count_targets(micro_batches, group)
    totals = torch.zeros(1 + len(STATS), device=num_targets.device)
    aux_total = torch.zeros((), device=num_targets.device)
    for i, mb in enumerate(micro_batches):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == num_micro - 1)  # reduce-scatter grads once per step
        loss_sum, aux = distill_forward(model, teacher, mb, objective, totals[1:], autocast)
        (loss_sum / num_targets + aux / (num_micro * dp_size)).backward()
        totals[0] += loss_sum.detach()
        aux_total += aux.detach()
    if group is not None:
        dist.all_reduce(aux_total, group=group)
    metrics = reduced_metrics(totals, group)
    loss = metrics["distill/loss"] + aux_total.item() / (num_micro * dp_size)
    grad_norm = clip_grad_norm(pm, cfg.train.grad_clip)
    ok = math.isfinite(loss) and bool(torch.isfinite(grad_norm))
    if ok:
        optimizer_step(optimizer, cfg.parallel.offload)
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # torch warns when a skipped update precedes the first scheduler step
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        scheduler.step()
    return {"loss": loss, **metrics, "grad_norm": grad_norm.item()}


@torch.no_grad()
def evaluate(pm: ParallelModel, teacher, objective: Objective, cfg, dp_rank: int, dp_size: int, group, device,
             autocast) -> dict:
    """distill/* over the first train.eval_steps micro-batches of the valid split."""
    from speedllm.data.loader import build_loader

    t = cfg.train
    loader = build_loader(cfg, "valid", dp_rank, dp_size, t.micro_batch_size, t.seq_len, cfg.seed)
    totals = torch.zeros(1 + len(STATS), device=device)
    pm.eval()
    for _, batch in zip(range(t.eval_steps), loader):
        loss_sum, _ = distill_forward(pm.module, teacher, to_device(batch, device), objective, totals[1:], autocast)
        totals[0] += loss_sum
    pm.train()
    return reduced_metrics(totals, group)


def run(cfg, rt: Runtime) -> None:
    """task=distill: train the student (model=) from distill.teacher; metrics and checkpoints go to the run dir."""
    t, ck = cfg.train, cfg.checkpoint
    dp_rank, dp_size, group = rt.dims.coords("dp")
    accum = grad_accum_steps(t, dp_size)
    seed_everything(cfg.seed)
    pm, optimizer, scheduler, loader, autocast, step, _ = build_training(cfg, rt)
    teacher = build_teacher(cfg, rt)
    objective = objective_of(cfg)
    logger = MetricsLogger(cfg.run_dir, t.steps, step, rt.is_main, cfg.logging.tensorboard, cfg.logging.progress_bar)
    stop_at = min(t.steps, step + t.stop_after) if t.stop_after > 0 else t.steps
    checkpointer = Checkpointer(ck.dir, ck.keep, ck.async_save)
    try:
        while step < stop_at:
            start = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            micro_batches = [to_device(next(loader), rt.device) for _ in range(accum)]
            metrics = distill_step(pm, teacher, optimizer, scheduler, micro_batches, objective, cfg, dp_size, group,
                                   autocast)
            step += 1
            logger.advance(step)
            if step % t.log_every == 0 or step == stop_at:
                tokens_per_s = t.global_batch_size * t.seq_len / (time.perf_counter() - start)
                logger.log(step, {**metrics, "lr": lr, "tokens_per_s": tokens_per_s,
                                  "peak_mem_gb": peak_memory_gb(rt.device)})
            if t.eval_every > 0 and step % t.eval_every == 0:
                valid = evaluate(pm, teacher, objective, cfg, dp_rank, dp_size, group, rt.device, autocast)
                logger.log(step, valid, prefix="valid")
            if (ck.every > 0 and step % ck.every == 0) or (step == stop_at and ck.save_final):
                checkpointer.save(step, pm.module, optimizer, extra_state(step, scheduler, loader, rt.device), cfg)
        checkpointer.close()
    finally:
        logger.close()
