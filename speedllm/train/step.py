"""One training step and the validation pass, exact whatever the split (see speedllm.tasks.pretrain).

A step consumes global_batch_size sequences: micro_batch_size per forward on each of the dp ranks,
accumulated over global_batch_size / (micro_batch_size * dp) micro-batches. The step's loss is
    sum of token cross-entropies over the whole global batch / number of target tokens in it
    + the MoE auxiliary loss averaged over micro-batches and ranks,
exactly, whatever the split: each micro-batch's summed cross-entropy is divided by the step's global
token count (counted up front), and the data-parallel gradient reduction sums instead of averaging.
"""

import math
import warnings
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn

from speedllm.ops import IGNORE_INDEX
from speedllm.parallel import ParallelModel, clip_grad_norm
from speedllm.parallel.offload import optimizer_step
from speedllm.train.build import to_device


def model_inputs(batch: Dict[str, torch.Tensor]) -> dict:
    """Keyword arguments of the model's forward present in a loader batch."""
    return {k: batch[k] for k in ("labels", "position_ids", "document_ids", "attention_mask") if k in batch}



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



def optimizer_update(pm: ParallelModel, optimizer, cfg, loss, scheduler=None) -> Tuple[torch.Tensor, bool]:
    """The tail of every training step (pretrain, sft, dpo, distill, grpo): clip the gradients to
    train.grad_clip, step the optimizer unless the loss or the gradient norm is not finite, clear the gradients,
    and step the LR schedule when given (skipped updates count: it follows the step number). Returns (grad_norm,
    ok), ok False for a skipped update."""
    grad_norm = clip_grad_norm(pm, cfg.train.grad_clip)
    ok = math.isfinite(float(loss)) and bool(torch.isfinite(grad_norm))
    if ok:
        optimizer_step(optimizer, cfg.parallel.offload)
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        with warnings.catch_warnings():  # torch warns when a skipped update precedes the first scheduler step
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
            scheduler.step()
    return grad_norm, ok


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
    grad_norm, ok = optimizer_update(pm, optimizer, cfg, loss, scheduler)
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
