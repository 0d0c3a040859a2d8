"""task=dpo: direct preference optimization (Rafailov et al., 2023) on preference pairs.

Per pair, with log-probabilities summed over the reply tokens (the labels of speedllm.data.pairs), the policy
π and the frozen reference π_ref:
    reward(side) = β (log π(side) − log π_ref(side))            side ∈ {chosen, rejected}
    loss         = −log σ(reward(chosen) − reward(rejected)), averaged over the pairs of the global batch
and the logged reward accuracy is the share of pairs whose chosen reward is the larger. With adapters
(finetune=lora|qlora) the reference is the same model with its adapters disabled; with finetune=full it is a
second, frozen model holding the starting weights. Like the training loop, each data-parallel rank divides its
sum by the global count and the gradient reduction sums. Runs without pipeline stages (parallel.pp=1).

Letters: B pairs per micro-batch, R = 2B rows (chosen, rejected interleaved), S sequence.
"""

import contextlib
import time
from typing import List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from speedllm.adapters.lora import adapters_disabled
from speedllm.errors import UserError
from speedllm.parallel.rules import dpo_layout_errors
from speedllm.planner.frozen import teacher_bytes
from speedllm.planner.spec import TaskSpec
from speedllm.planner.timing import forward_seconds
from speedllm.runtime import Runtime, seed_everything
from speedllm.train.build import build_training, frozen_reference, grad_accum_steps, to_device, training_loop
from speedllm.train.state import extra_state
from speedllm.train.step import optimizer_update


def reply_logps(model: nn.Module, tokens_RS: torch.Tensor, labels_RS: torch.Tensor) -> tuple:
    """(log-probability of each row's labelled tokens [R], summed MoE aux loss), one row per forward so the
    model's chunked loss gives per-row sums without materializing logits."""
    rows, aux_total = [], 0.0
    for tokens, labels in zip(tokens_RS.split(1), labels_RS.split(1)):
        ce_sum, aux = model(tokens, labels=labels)
        rows.append(-ce_sum)
        aux_total = aux_total + aux
    return torch.stack(rows), aux_total


def dpo_losses(policy_R: torch.Tensor, reference_R: torch.Tensor, beta: float) -> tuple:
    """(per-pair losses [B], chosen rewards [B], rejected rewards [B]) from per-row log-probs (chosen first)."""
    rewards = beta * (policy_R - reference_R).view(-1, 2)
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return -F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach()


def dpo_step(pm, reference, optimizer, scheduler, micro_batches: List[dict], cfg, dp_size, group,
             autocast) -> dict:
    """One optimizer step over this rank's micro-batches of pairs; returns the step's metrics (all ranks).

    pm: the policy (a ParallelModel without pipeline stages); reference: the frozen reference model, or None
    for the policy with its adapters disabled.
    """
    model = pm.module
    num_micro = len(micro_batches)
    device = micro_batches[0]["tokens"].device
    num_pairs = torch.tensor(float(sum(mb["tokens"].shape[0] for mb in micro_batches)), device=device)
    if group is not None:
        dist.all_reduce(num_pairs, group=group)
    totals = torch.zeros(4, device=device)  # loss sum, chosen reward sum, rejected reward sum, correct
    for mb in micro_batches:
        tokens, labels = mb["tokens"].flatten(0, 1), mb["labels"].flatten(0, 1)  # [B, 2, S] -> [R, S]
        with torch.no_grad(), autocast:
            with adapters_disabled() if reference is None else contextlib.nullcontext():
                reference_R, _ = reply_logps(model if reference is None else reference, tokens, labels)
        with autocast:
            policy_R, aux = reply_logps(model, tokens, labels)
        losses, chosen, rejected = dpo_losses(policy_R.float(), reference_R.float(), cfg.dpo.beta)
        (losses.sum() / num_pairs + aux / (tokens.shape[0] * num_micro * dp_size)).backward()
        totals += torch.stack([losses.detach().sum(), chosen.sum(), rejected.sum(), (chosen > rejected).sum()])
    if group is not None:
        dist.all_reduce(totals, group=group)
    loss, chosen, rejected, correct = (totals / num_pairs).tolist()
    grad_norm, _ = optimizer_update(pm, optimizer, cfg, loss, scheduler)
    return {"loss": loss, "reward_chosen": chosen, "reward_rejected": rejected, "reward_margin": chosen - rejected,
            "reward_accuracy": correct, "grad_norm": grad_norm.item()}


def run(cfg, rt: Runtime) -> None:
    """task=dpo: train the policy on data.format=pairs; metrics, checkpoints (as task=sft) go to the run dir."""
    t, ck = cfg.train, cfg.checkpoint
    dp_rank, dp_size, group = rt.dims.coords("dp")
    accum = grad_accum_steps(t, dp_size)
    reference = None
    if cfg.finetune.name == "full":  # else the policy with its adapters off
        reference = frozen_reference(cfg, rt)
    seed_everything(cfg.seed)
    pm, optimizer, scheduler, loader, autocast, step, _ = build_training(cfg, rt)
    logger, checkpointer, stop_at = training_loop(cfg, rt, step)
    try:
        while step < stop_at:
            start = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            micro_batches = [to_device(next(loader), rt.device) for _ in range(accum)]
            metrics = dpo_step(pm, reference, optimizer, scheduler, micro_batches, cfg, dp_size, group, autocast)
            step += 1
            logger.advance(step)
            if step % t.log_every == 0 or step == stop_at:
                pairs_per_s = t.global_batch_size / (time.perf_counter() - start)
                logger.log(step, {**metrics, "lr": lr, "pairs_per_s": pairs_per_s})
            if (ck.every > 0 and step % ck.every == 0) or (step == stop_at and ck.save_final):
                checkpointer.save(step, pm.module, optimizer, extra_state(step, scheduler, loader, rt.device), cfg)
        checkpointer.close()
    finally:
        logger.close()


# ------------------------------------------------------------------- what task=dpo declares (speedllm.planner.spec)

def layout_errors(run, layout, frozen=None) -> List[str]:
    return dpo_layout_errors(pp=layout.pp)


def check_inputs(cfg) -> None:
    if cfg.data.format != "pairs":
        raise UserError(f"task=dpo needs preference pairs; set data.format=pairs (now {cfg.data.format})")
    if cfg.data.input is None:
        raise UserError("task=dpo needs data.input=<json/jsonl of prompt/chosen/rejected pairs>")


def frozen_model(run):
    """The reference: a frozen copy of the starting weights with full fine-tuning (adapters turn off instead)."""
    return run.model if run.finetune.name == "full" else None


def memory(run, frozen, rank) -> dict:
    return {} if frozen is None else {"teacher": teacher_bytes(frozen, rank.layout, rank.hardware.dtype)}


def extra_seconds(run, frozen, rank) -> float:
    """The reference's forward over both replies of every pair."""
    t = run.train
    return forward_seconds(run.model, rank.layout, rank.hardware, 2 * t.global_batch_size * t.seq_len, t.seq_len,
                           rank.efficiency)


SPEC = TaskSpec(layout_errors=layout_errors, inputs=check_inputs, rows_per_item=2, frozen_model=frozen_model,
                memory=memory, extra_seconds=extra_seconds)
