"""Divergences between a teacher's and a student's next-token distributions, chunk by chunk (task=distill).

Per labelled position, with p_t = softmax(teacher logits / T), p_s = softmax(student logits / T):
    forward_kl   KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)
    reverse_kl   KL(p_s || p_t)
    jsd          beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = beta p_t + (1 - beta) p_s,
                 the generalized Jensen-Shannon divergence of GKD (Agarwal et al., 2024) exactly as TRL's
                 GKDTrainer.generalized_jsd_loss computes it: beta = 0 is the forward KL, beta = 1 the reverse
and the position's loss is (1 - ce_weight) divergence + ce_weight cross-entropy (the labels', at temperature 1).
With top_k > 0 the teacher keeps its top_k tokens, renormalized (p_t = 0 elsewhere; the student is not truncated).

Like the cross-entropy (speedllm.ops.loss), the student's logits are made one chunk of positions at a time and turned
into their gradient in place, so only one chunk of each model's logits is alive at once; the teacher's logits of the
chunk come from its final hidden states and output weight, under no gradient. Under tensor parallelism both output
weights are vocabulary-sharded alike (Shard(0) of the same vocabulary on the same axis) and every sum, maximum and
top-k over the vocabulary is reduced over the tensor axis, so no rank holds a whole vocabulary row.

Letters: N positions, D features (Ds student, Dt teacher), V vocabulary (Vt: this rank's share of it).
"""

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from speedllm.ops import IGNORE_INDEX
from speedllm.ops.loss import ChunkedLinearCrossEntropy, chunk_rows
from speedllm.ops.reference import zero_unlabeled_

LOSSES = ("forward_kl", "reverse_kl", "jsd")
# what one chunk holds at once: the student's and the teacher's fp32 logits and about four temporaries of that size
LIVE_CHUNKS = 6
# the entries of a `stats` tensor: sums over labelled positions
STATS = ("kl", "ce", "top1_agree", "positions")


@dataclass(frozen=True)
class Objective:
    """What a position's loss is (the distill config section's values)."""

    loss: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    top_k: int = 0
    ce_weight: float = 0.0


def _sum(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """x reduced over the tensor axis (in place), or x itself in one process."""
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _logsumexp(x_NV: torch.Tensor, group) -> torch.Tensor:
    """Row log-sum-exp over the whole vocabulary [N] (-inf entries are allowed, not whole rows of them)."""
    max_N = _sum(x_NV.amax(dim=1), group, dist.ReduceOp.MAX)
    return _sum((x_NV - max_N[:, None]).exp().sum(dim=1), group).log() + max_N


def _argmax(x_NV: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """Row argmax over the whole vocabulary [N]: the first index of the maximum, as torch.argmax."""
    local_max, local_idx = x_NV.max(dim=1)
    if group is None:
        return local_idx
    global_max = _sum(local_max.clone(), group, dist.ReduceOp.MAX)
    index = torch.where(local_max == global_max, local_idx + vocab_start, torch.iinfo(torch.int64).max)
    return _sum(index, group, dist.ReduceOp.MIN)


def _top_k_mask(t_NV: torch.Tensor, k: int, group) -> torch.Tensor:
    """True at each row's k largest entries over the whole vocabulary (ties at the k-th value all kept)."""
    local = t_NV.topk(min(k, t_NV.shape[1]), dim=1).values
    if group is not None:
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        local = torch.cat(gathered, dim=1)
    return t_NV >= local.topk(k, dim=1).values[:, -1:]


def _xlogy_diff(p: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """p (log_a - log_b), 0 where p is 0 (a top-k teacher's dropped tokens, where log_a is -inf)."""
    return torch.where(p > 0, p * (log_a - log_b), 0.0)


def _chunk(s_NV: torch.Tensor, rows_N: torch.Tensor, *, teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
           labels: torch.Tensor, objective: Objective, stats: torch.Tensor, vocab_start: int, group):
    """One chunk: (sum of the positions' losses, d(sum)/d(student logits)) with s_NV, the student's fp32 logits of
    the positions rows_N, turned into that gradient in place; the chunk's STATS are added to `stats`."""
    o, T = objective, objective.temperature
    t_NV = (teacher_hidden.index_select(0, rows_N) @ teacher_weight.t()).float()
    labels_N = labels.index_select(0, rows_N)
    keep = labels_N != IGNORE_INDEX
    # cross-entropy of the labels at temperature 1 (vocabulary-parallel: the target logit where this rank holds it)
    local = labels_N - vocab_start
    mine = (local >= 0) & (local < s_NV.shape[1])
    local = local.clamp(0, s_NV.shape[1] - 1)[:, None]
    lse_s = _logsumexp(s_NV, group)
    ce_N = lse_s - _sum(s_NV.gather(1, local).squeeze(1) * mine, group)
    agree_N = _argmax(s_NV, vocab_start, group) == _argmax(t_NV, vocab_start, group)

    log_ps = s_NV / T
    log_ps -= _logsumexp(log_ps, group)[:, None]
    log_pt = t_NV.div_(T)
    log_pt_full = log_pt - _logsumexp(log_pt, group)[:, None]
    if o.top_k > 0:
        log_pt = log_pt.masked_fill_(~_top_k_mask(log_pt, o.top_k, group), -math.inf)
        log_pt -= _logsumexp(log_pt, group)[:, None]
    else:
        log_pt = log_pt_full
    p_s, p_t = log_ps.exp(), log_pt.exp()
    kl_N = _sum(_xlogy_diff(log_pt_full.exp(), log_pt_full, log_ps).sum(dim=1), group)
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(o.loss, o.beta)
    if beta == 0:  # forward KL: d/d(logits / T) = p_s - p_t
        div_N = kl_N if o.top_k == 0 else _sum(_xlogy_diff(p_t, log_pt, log_ps).sum(dim=1), group)
        grad = p_s.sub_(p_t)
    else:
        # d/dp_s of the divergence is (1 - beta) (log p_s - log m) (reverse KL: log p_s - log p_t, the same at
        # beta = 1); through the softmax: p_s (g - sum_v p_s g)
        if beta == 1:
            div_N = _sum((p_s * (log_ps - log_pt)).sum(dim=1), group)
            g = log_ps - log_pt
        else:
            log_m = torch.logaddexp(log_ps + math.log1p(-beta), log_pt + math.log(beta))
            div_N = _sum((beta * _xlogy_diff(p_t, log_pt, log_m) + (1 - beta) * p_s * (log_ps - log_m)).sum(dim=1),
                         group)
            g = (log_ps - log_m).mul_(1 - beta)
        grad = g.sub_(_sum((p_s * g).sum(dim=1), group)[:, None]).mul_(p_s)
    grad.mul_((1 - o.ce_weight) / T)
    if o.ce_weight > 0:  # + ce_weight (softmax - one-hot)
        grad.add_((s_NV - lse_s[:, None]).exp_().mul_(o.ce_weight))
        grad.scatter_add_(1, local, (-o.ce_weight * mine.float())[:, None])
    loss_N = (1 - o.ce_weight) * div_N + o.ce_weight * ce_N
    stats += torch.stack([(x * keep).sum() for x in (kl_N, ce_N, agree_N.float(), torch.ones_like(kl_N))])
    return (loss_N * keep).sum(), zero_unlabeled_(s_NV.copy_(grad), keep)


def _local(hidden_ND: torch.Tensor, weight_VD: torch.Tensor):
    """(hidden, weight rows, first vocabulary row, group) of this rank: the tensors themselves in one process (or
    under FSDP, which hands the forward whole weights); under tensor parallelism replicated hidden states and the
    rank's vocabulary rows (speedllm.parallel.tensor.vocab_parallel_operands)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(weight_VD, DTensor):
        return hidden_ND, weight_VD, 0, None
    from speedllm.parallel.tensor import vocab_parallel_operands

    return vocab_parallel_operands(hidden_ND, weight_VD)


def distill_loss(hidden_ND, weight_VD, labels_N, chunk_size, ops=None, *, teacher_hidden,
                 teacher_weight, objective: Objective, stats: torch.Tensor) -> torch.Tensor:
    """Sum over the labelled positions of the Objective's loss: a drop-in for the model's output loss
    (speedllm.ops.loss.chunked_cross_entropy; passed per call as Qwen3's `output_loss`).

    Args:
        hidden_ND, weight_VD: the student's final hidden states and output weight (a vocabulary-sharded DTensor
            under tensor parallelism); labels_N: the targets, IGNORE_INDEX = no loss.
        chunk_size: positions per chunk; 0: chunks whose LIVE_CHUNKS fp32 [positions, V] buffers fit the budget of
            speedllm.ops.loss.chunk_rows.
        teacher_hidden, teacher_weight: the teacher's final hidden states [N, Dt] (may be a sequence-sharded DTensor)
            and output weight, laid out like the student's.
        stats: float [len(STATS)], to which the sums of STATS are added.
    """
    hidden, weight, vocab_start, group = _local(hidden_ND, weight_VD)
    t_hidden, t_weight, _, _ = _local(teacher_hidden, teacher_weight)
    if chunk_size == 0:
        chunk_size = max(1, chunk_rows(0, hidden.shape[0], weight.shape[0]) // LIVE_CHUNKS)
    chunk_fn = partial(_chunk, teacher_hidden=t_hidden, teacher_weight=t_weight, labels=labels_N, objective=objective,
                       stats=stats, vocab_start=vocab_start, group=group)
    # the chunked projection hands chunk_fn each chunk's positions: their row numbers stand in for the labels
    rows_N = torch.arange(hidden.shape[0], device=hidden.device)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return ChunkedLinearCrossEntropy.apply(hidden, weight, rows_N, chunk_size, chunk_fn)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_size):
        rows = rows_N[start:start + chunk_size]
        total += chunk_fn((hidden.index_select(0, rows) @ weight.t()).float(), rows)[0]
    return total


def final_hidden(hidden_ND, weight_VD, labels_N, chunk_size, ops=None) -> torch.Tensor:
    """The final hidden states, in place of the output loss (Qwen3's `output_loss`): the teacher's forward."""
    return hidden_ND
