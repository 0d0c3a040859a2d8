"""task=distill: a student learns a frozen teacher's next-token distributions (knowledge distillation).

Off-policy, on the sequences of `data=` (pretraining or SFT data, with their loss masks): each labelled position's
loss is a divergence between the teacher's and the student's distributions at distill.temperature (forward KL,
reverse KL or GKD's generalized JSD, speedllm.train.distill_loss), optionally mixed with the labels' cross-entropy.
The teacher (speedllm.train.teacher) is built under the student's layout and runs without gradients; its final
hidden states and output weight go into the student's output loss, which makes both models' logits one chunk of
positions at a time. Like the training loop (speedllm.train.step), each rank divides its sum by the step's global
count of labelled positions and the data-parallel gradient reduction sums, so the step is exact whatever the split.

On-policy (distill.on_policy = λ, GKD's student-data fraction): each step samples with probability λ, drawn from
the run's seed and the step (the same on every rank and on resume). On a sampled step the student completes each
row's prompt with the shared rollout (speedllm.generation.rollout, the training model itself at temperature 1), the
teacher scores every sampled token, and the loss is the configured objective (distill.loss, beta, top_k, ce_weight;
the cross-entropy's labels are then the sampled tokens) on those samples, as in GKD. A row's prompt is its tokens up
to its first label (SFT: the prompt turns), or the first half of a row labelled from its start (pretraining data);
completions run to train.seq_len / 2 tokens. Every eval also samples the held-out prompts and reports the reverse KL
on them: `distill/sample_reverse_kl`.
Runs without pipeline stages and context parallelism.
"""

import time
from functools import partial
from typing import Any, List, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from speedllm.errors import UserError
from speedllm.generation.rollout import draw_generators, rollout
from speedllm.generation.sampling import Sampling
from speedllm.hardware import DTYPES
from speedllm.ops import IGNORE_INDEX
from speedllm.parallel import ParallelModel
from speedllm.parallel.rules import distill_layout_errors
from speedllm.parallel.rules import layout_errors as rule_errors
from speedllm.planner.frozen import teacher_bytes
from speedllm.planner.spec import TaskSpec, above, at_least, fraction, refuse_pairs
from speedllm.planner.timing import forward_seconds
from speedllm.runtime import Runtime, seed_everything
from speedllm.train.build import build_training, grad_accum_steps, to_device, training_loop
from speedllm.train.distill_loss import STATS, Objective, distill_loss
from speedllm.train.metrics import peak_memory_gb
from speedllm.train.state import extra_state
from speedllm.train.step import count_targets, model_inputs, optimizer_update
from speedllm.train.teacher import build_teacher, check_teacher, head_weight, teacher_hidden, teacher_source


def objective_of(cfg) -> Objective:
    d = cfg.distill
    return Objective(d.loss, d.beta, d.temperature, d.top_k or 0, d.ce_weight)


def reverse_kl_objective(cfg) -> Objective:
    """The held-out metric on the student's own samples: the per-token reverse KL."""
    return Objective("reverse_kl", temperature=cfg.distill.temperature)


class Sampler(NamedTuple):
    """What the student's rollouts need beyond the model: the tokenizer's ids and this rank's place."""

    stop_ids: List[int]
    pad_id: int
    dtype: torch.dtype
    tp: int
    group: Any  # the ranks whose forwards run together (the whole job), None in one process
    seed: int


def sampler_of(cfg, rt: Runtime) -> Sampler:
    from speedllm.data.tokenizer import pad_id_of, stop_ids_of, tokenizer_for

    tokenizer = tokenizer_for(cfg)
    group = dist.group.WORLD if rt.world_size > 1 else None
    return Sampler(stop_ids_of(tokenizer), pad_id_of(tokenizer), DTYPES[cfg.hardware.dtype], rt.dims.tp, group,
                   cfg.seed)


_EVAL_STREAM = 1  # the held-out samples' draws: a stream of their own
_ON_POLICY = 2  # the stream of the steps' on-policy draws


def is_on_policy(step: int, fraction: float, seed: int) -> bool:
    """Whether step (counted from 1) samples: with probability `fraction`, drawn from (seed, step) alone, so every
    rank and a resumed run draw alike."""
    draw = torch.rand((), generator=draw_generators(seed, [step], "cpu", _ON_POLICY)[0])
    return fraction > 0 and draw.item() < fraction


def prompts_of(batch: dict) -> List[List[int]]:
    """Each row's prompt: its tokens up to its first label, or its first half when it is labelled from the start."""
    prompts = []
    for tokens, labels in zip(batch["tokens"].tolist(), batch["labels"].tolist()):
        first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), 0)
        prompts.append(tokens[:first + 1] if first > 0 else tokens[:len(tokens) // 2])
    return prompts


@torch.no_grad()
def sampled_batch(model, batch: dict, max_new_tokens: int, sampler: Sampler, first: int, *stream: int) -> dict:
    """The student's completions of the batch's prompts as a batch whose labels are the sampled tokens: tokens,
    labels, position_ids, attention_mask; right-padded to a multiple of the tensor-parallel degree (sequence
    parallel splits the sequence). Row i is sample `first` + i of the data (the loader's first_index), whose index
    (and `stream`) seeds its draw: the same completions whatever the layout."""
    device = batch["tokens"].device
    prompts = prompts_of(batch)
    generators = draw_generators(sampler.seed, range(first, first + len(prompts)), device, *stream)
    ro = rollout(model, prompts, 1, max_new_tokens, Sampling(temperature=1.0), generators, sampler.stop_ids,
                 sampler.pad_id, sampler.dtype, sampler.tp, sampler.group)
    P, C = ro.prompt_width, ro.completion_mask.shape[1]
    labels = torch.full_like(ro.tokens, IGNORE_INDEX)
    labels[:, P - 1:P + C - 1] = torch.where(ro.completion_mask.bool(), ro.tokens[:, P:], IGNORE_INDEX)
    pad = -ro.tokens.shape[1] % sampler.tp
    last = ro.position_ids[:, -1:]
    return {"tokens": F.pad(ro.tokens, (0, pad), value=sampler.pad_id), "labels": F.pad(labels, (0, pad),
            value=IGNORE_INDEX), "attention_mask": F.pad(ro.attention_mask, (0, pad), value=0),
            "position_ids": torch.cat([ro.position_ids, last + torch.arange(1, pad + 1, device=device)], dim=1)}


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
    grad_norm, _ = optimizer_update(pm, optimizer, cfg, loss, scheduler)
    return {"loss": loss, **metrics, "grad_norm": grad_norm.item()}


@torch.no_grad()
def evaluate(pm: ParallelModel, teacher, objective: Objective, cfg, dp_rank: int, dp_size: int, group, device,
             autocast, sampler: Sampler) -> dict:
    """distill/* over the first train.eval_steps micro-batches of the valid split, and the reverse KL on the
    student's samples of their prompts (distill/sample_reverse_kl)."""
    from speedllm.data.loader import build_loader

    t = cfg.train
    loader = build_loader(cfg, "valid", dp_rank, dp_size, t.micro_batch_size, t.seq_len, cfg.seed)
    totals = torch.zeros(1 + len(STATS), device=device)
    sampled = torch.zeros(1 + len(STATS), device=device)
    pm.eval()
    for _ in range(t.eval_steps):
        first = loader.first_index
        batch = to_device(next(loader), device)
        loss_sum, _ = distill_forward(pm.module, teacher, batch, objective, totals[1:], autocast)
        totals[0] += loss_sum
        with autocast:
            samples = sampled_batch(pm.module, batch, t.seq_len // 2, sampler, first, _EVAL_STREAM)
        loss_sum, _ = distill_forward(pm.module, teacher, samples, reverse_kl_objective(cfg), sampled[1:], autocast)
        sampled[0] += loss_sum
    pm.train()
    return {**reduced_metrics(totals, group),
            "distill/sample_reverse_kl": reduced_metrics(sampled, group)["distill/loss"]}


def run(cfg, rt: Runtime) -> None:
    """task=distill: train the student (model=) from distill.teacher; metrics and checkpoints go to the run dir."""
    t, ck = cfg.train, cfg.checkpoint
    dp_rank, dp_size, group = rt.dims.coords("dp")
    accum = grad_accum_steps(t, dp_size)
    seed_everything(cfg.seed)
    pm, optimizer, scheduler, loader, autocast, step, _ = build_training(cfg, rt)
    teacher = build_teacher(cfg, rt)
    objective = objective_of(cfg)
    sampler = sampler_of(cfg, rt)
    logger, checkpointer, stop_at = training_loop(cfg, rt, step)
    try:
        while step < stop_at:
            start = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            firsts, micro_batches = [], []
            for _ in range(accum):
                firsts.append(loader.first_index)
                micro_batches.append(to_device(next(loader), rt.device))
            on_policy = is_on_policy(step + 1, cfg.distill.on_policy, cfg.seed)
            if on_policy:
                with autocast:
                    micro_batches = [sampled_batch(pm.module, mb, t.seq_len // 2, sampler, first)
                                     for first, mb in zip(firsts, micro_batches)]
            metrics = distill_step(pm, teacher, optimizer, scheduler, micro_batches, objective, cfg, dp_size, group,
                                   autocast)
            step += 1
            logger.advance(step)
            if step % t.log_every == 0 or step == stop_at:
                tokens_per_s = t.global_batch_size * t.seq_len / (time.perf_counter() - start)
                logger.log(step, {**metrics, "on_policy": float(on_policy), "lr": lr, "tokens_per_s": tokens_per_s,
                                  "peak_mem_gb": peak_memory_gb(rt.device)})
            if t.eval_every > 0 and step % t.eval_every == 0:
                valid = evaluate(pm, teacher, objective, cfg, dp_rank, dp_size, group, rt.device, autocast, sampler)
                logger.log(step, valid, prefix="valid")
            if (ck.every > 0 and step % ck.every == 0) or (step == stop_at and ck.save_final):
                checkpointer.save(step, pm.module, optimizer, extra_state(step, scheduler, loader, rt.device), cfg)
        checkpointer.close()
    finally:
        logger.close()


# --------------------------------------------------------------- what task=distill declares (speedllm.planner.spec)

VALUES = {
    "distill.beta": (fraction, "in [0, 1]"),
    "distill.temperature": above(0),
    "distill.ce_weight": (fraction, "in [0, 1]"),
    "distill.on_policy": (fraction, "in [0, 1]"),
    "distill.top_k": at_least(1),  # null: the teacher's whole distribution
}


def frozen_model(run):
    """The teacher's model (speedllm.train.teacher), None until distill.teacher names one."""
    return None if run.distill.teacher is None else teacher_source(str(run.distill.teacher)).model


def layout_errors(run, layout, frozen=None) -> List[str]:
    """No pipeline stages or context parallelism; the teacher's placement (distill_layout_errors); and the teacher
    model under the student's degrees (it is built under the same tp, ep and dp)."""
    d, lay = run.distill, layout
    errors = distill_layout_errors(pp=lay.pp, cp=lay.cp, tp=lay.tp, dp=lay.dp, fsdp=lay.fsdp,
                                   teacher_quant=d.teacher_quant, teacher_parallel=d.teacher_parallel,
                                   name=run.parallel.name)
    if frozen is not None and not errors:
        errors = [f"distill.teacher={d.teacher}: {e}" for e in
                  rule_errors(frozen, tp=lay.tp, pp=1, vpp=1, ep=lay.ep, cp=1, dp=lay.dp, schedule=lay.schedule,
                              sequence_parallel=lay.sequence_parallel)]
    return errors


def extras(run):
    if run.distill.teacher_quant != "none":
        yield f"distill.teacher_quant={run.distill.teacher_quant}", "torchao", "quant"


def check_inputs(cfg) -> None:
    """The settings that have no finite loss, and the teacher (speedllm.train.teacher.check_teacher)."""
    d = cfg.distill
    refuse_pairs(cfg)
    if d.top_k is not None and d.top_k > cfg.model.vocab_size:
        raise UserError(f"distill.top_k={d.top_k} exceeds the vocabulary ({cfg.model.vocab_size}); use a smaller k, "
                        "or distill.top_k=null for the whole distribution")
    reverse = d.loss == "reverse_kl" or d.loss == "jsd" and d.beta == 1
    if d.top_k is not None and reverse:
        raise UserError(f"distill.top_k={d.top_k} with the reverse KL (distill.loss={d.loss}, beta={d.beta}) is "
                        "infinite where the student puts mass outside the teacher's top k; use distill.top_k=null, or "
                        "distill.loss=forward_kl|jsd with beta < 1")
    check_teacher(cfg)


def memory(run, frozen, rank) -> dict:
    """The teacher's weights on this rank (planner.frozen.teacher_bytes)."""
    if frozen is None:
        return {}
    d = run.distill
    return {"teacher": teacher_bytes(frozen, rank.layout, rank.hardware.dtype, quant=d.teacher_quant,
                                     whole=d.teacher_parallel == "replicate")}


def extra_seconds(run, frozen, rank) -> float:
    """The teacher's forward over the step's tokens."""
    if frozen is None:
        return 0.0
    t = run.train
    return forward_seconds(frozen, rank.layout, rank.hardware, t.global_batch_size * t.seq_len, t.seq_len,
                           rank.efficiency)


SPEC = TaskSpec(layout_errors=layout_errors, values=VALUES, extras=extras, inputs=check_inputs,
                frozen_model=frozen_model, memory=memory, extra_seconds=extra_seconds,
                batch_invariant=lambda run: run.distill.on_policy > 0)
