"""task=grpo: reinforcement learning with verifiable rewards (GRPO and its variants) on the training model itself.

Each step, read top to bottom:
1. draw rl.prompts_per_step prompts (speedllm.data.prompts.PromptOrder); each data-parallel rank takes its share;
2. sample rl.group_size completions of each with the training model, under its training layout, through the KV
   cache (speedllm.generation.rollout: no weight copy), recording their log-probabilities (and MoE routes);
3. score every completion of every rank with each rl.rewards function (TRL's signature) on every rank, so a
   reward that fails stops all ranks with the same one line; group-relative advantages
   (speedllm.train.policy_loss); DAPO's dynamic sampling replaces groups whose rewards are all equal;
4. the reference model's log-probabilities (rl.kl_coef > 0: a frozen copy, or the policy with its adapters off);
5. rl.ppo_epochs x rl.mini_batches clipped policy-gradient updates, the rollout's log-probabilities as the old
   policy (rl.old_logprobs=recompute: a training forward's, with rl.rollout_correction's TIS / MIS weights); for
   MoE the rollout's experts are replayed (rl.router_replay). The LR schedule steps once per step.

Prompt draws and sampling are seeded by (seed, draw number): a resume samples what the straight run samples, and
a data-parallel split samples what one process does. Runs without pipeline stages (parallel.pp=1).

Letters: N rows (this rank's completions), C completion columns, F reward functions, G group size.
"""

import contextlib
import copy
import functools
import math
import numbers
import os
import time
from collections.abc import Iterator, Sized
from typing import List

import torch
import torch.distributed as dist
from hydra.utils import get_method
from omegaconf import OmegaConf

from speedllm.adapters.lora import adapters_disabled
from speedllm.data.preprocess import expand_inputs
from speedllm.data.prompts import PromptOrder, load_prompts
from speedllm.data.tokenizer import load_tokenizer, pad_id_of, stop_ids_of
from speedllm.errors import UserError
from speedllm.generation.rollout import (Rollout, completion_logprobs, concat, draw_generators, policy_temperature,
                                         rollout)
from speedllm.generation.sampling import Sampling
from speedllm.hardware import DTYPES
from speedllm.models.moe import replay_routes
from speedllm.models.rope import max_positions
from speedllm.parallel.rules import grpo_layout_errors
from speedllm.planner.frozen import rollout_cache_bytes, teacher_bytes
from speedllm.planner.spec import TaskSpec, above, at_least
from speedllm.planner.timing import decode_seconds, forward_seconds
from speedllm.runtime import Runtime, seed_everything
from speedllm.train.build import build_training, frozen_reference, training_loop
from speedllm.train.faults import BadSteps, Preemption
from speedllm.train.policy_loss import group_advantages, policy_loss, rollout_correction
from speedllm.train.rewards import length_penalty
from speedllm.train.state import extra_state
from speedllm.train.step import optimizer_update
from speedllm.train.tools import ToolRunner, build_tools, conversation, tool_schemas


def build_rewards(rl) -> list:
    """(name, fn, weight) of each rl.rewards entry (other keys bound as keyword arguments), plus DAPO's overlong
    penalty when rl.overlong_buffer > 0."""
    rewards = []
    for entry in rl.rewards:
        entry = dict(OmegaConf.to_container(entry, resolve=True)) if OmegaConf.is_config(entry) else dict(entry)
        target, weight = entry.pop("_target_"), float(entry.pop("weight", 1.0))
        fn = get_method(target)
        rewards.append((target.rsplit(".", 1)[-1], functools.partial(fn, **entry) if entry else fn, weight))
    if rl.overlong_buffer > 0:
        rewards.append(("overlong", functools.partial(length_penalty, max_tokens=rl.max_new_tokens,
                                                      buffer=rl.overlong_buffer, penalty=rl.overlong_penalty), 1.0))
    return rewards


def score(rewards: list, prompts: list, completions: list, columns: dict, prompt_of_row: List[int]) -> torch.Tensor:
    """rewards_NF: each function's rewards for every row; a function that raises (or exits), returns the wrong
    number of values, or a None / NaN is one line naming it and the prompt (its index in data.input). Each function
    gets its own copy of the lists (one that empties them changes nothing after it); an iterator it returns is
    read to its end."""
    out = []
    for name, fn, _ in rewards:
        given = copy.deepcopy((prompts, completions, columns))
        try:
            values = fn(given[0], given[1], **given[2])
            if isinstance(values, Iterator):  # a generator: its values
                values = list(values)
        except Exception as e:  # a user's function: any failure is theirs to fix
            raise UserError(f"rl.rewards: {name} raised {type(e).__name__}: {e} (on the completions of prompt "
                            f"{_failing_prompt(fn, prompts, completions, columns, prompt_of_row)}) — fix the "
                            "function") from None
        except SystemExit as e:  # sys.exit() in a reward would end the run as if it had finished
            raise UserError(f"rl.rewards: {name} called sys.exit({e.code!r}) — a reward function returns one float "
                            "per completion and never exits") from None
        if not isinstance(values, Sized) or len(values) != len(completions):
            got = "None" if values is None else len(values) if isinstance(values, Sized) else type(values).__name__
            raise UserError(f"rl.rewards: {name} returned {got} values for {len(completions)} completions — return "
                            "one float per completion")
        for row, value in enumerate(values):
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise UserError(f"rl.rewards: {name} returned {value!r} for a completion of prompt "
                                f"{prompt_of_row[row]} (row {row}) — return a finite float for every completion")
        out.append(torch.tensor(list(values), dtype=torch.float32))
    return torch.stack(out, dim=1)


def _failing_prompt(fn, prompts, completions, columns, prompt_of_row) -> str:
    """The first prompt (index in data.input) whose completions alone make `fn` raise, found by calling it on
    each prompt's rows; all of them if none does alone."""
    for prompt in dict.fromkeys(prompt_of_row):
        rows = [i for i, p in enumerate(prompt_of_row) if p == prompt]
        try:
            fn(*copy.deepcopy(([prompts[i] for i in rows], [completions[i] for i in rows])),
               **copy.deepcopy({k: [v[i] for i in rows] for k, v in columns.items()}))
        except Exception:  # the failure being located
            return str(prompt)
    return str(sorted(set(prompt_of_row)))


def gather_lists(values: list, group) -> list:
    """The concatenation of every data-parallel rank's `values`, in rank order."""
    if group is None:
        return values
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, values, group=group)
    return [v for part in parts for v in part]


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class Sampler:
    """Rollouts and rewards of this rank: its share of a batch of prompt draws, scored globally."""

    def __init__(self, cfg, rt, data, tokenizer, rewards, order, autocast):
        self.cfg, self.rl, self.data, self.tokenizer, self.rewards, self.order = cfg, cfg.rl, data, tokenizer, \
            rewards, order
        self.autocast = autocast  # the training forward's precision (bf16 mixed precision: autocast), also here
        self.dp_rank, self.dp_size, self.dp_group = rt.dims.coords("dp")
        self.world = dist.group.WORLD if rt.world_size > 1 else None
        self.device = rt.device
        self.stop_ids, self.pad_id = stop_ids_of(tokenizer), pad_id_of(tokenizer)
        self.sampling = Sampling(temperature=float(cfg.rl.temperature), top_p=float(cfg.rl.top_p))
        self.dtype = DTYPES[cfg.hardware.dtype]
        self.tools = None
        if cfg.rl.tools:
            _, tp_size, tp_group = rt.dims.coords("tp")
            self.tools = ToolRunner(build_tools(cfg.rl.tools), tokenizer, cfg.rl.max_turns, cfg.rl.tool_timeout_s,
                                    cfg.rl.tool_max_chars, tp_group if tp_size > 1 else None)

    def sample(self, model) -> tuple:
        """(Rollout of this rank's rows, rewards_NF of all rows, this rank's first row, completion texts of all
        rows, prompt index of all rows) for the next rl.prompts_per_step draws."""
        rl = self.rl
        first_draw = self.order.taken
        prompt_ids = self.order.take(rl.prompts_per_step)
        share = rl.prompts_per_step // self.dp_size
        lo = self.dp_rank * share
        mine = prompt_ids[lo:lo + share]
        generators = draw_generators(self.cfg.seed, range(first_draw + lo, first_draw + lo + share), self.device)
        was_training = model.training
        model.eval()
        with self.autocast:
            ro = rollout(model, [self.data.ids[i] for i in mine], rl.group_size, rl.max_new_tokens, self.sampling,
                         generators, self.stop_ids, self.pad_id, self.dtype, tp=self.cfg.parallel.tp,
                         group=self.world, tools=self.tools)
        model.train(was_training)
        ids = gather_lists(ro.completion_ids(), self.dp_group)
        prompt_of_row = [i for i in prompt_ids for _ in range(rl.group_size)]
        texts = [self.tokenizer.decode([t for t in row if t not in self.stop_ids], skip_special_tokens=True)
                 for row in ids]
        prompts = [self.data.prompts[i] for i in prompt_of_row]
        if self.tools is None:
            completions = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                           for p, t in zip(prompts, texts)]
        else:  # the whole conversation, TRL's multi-turn shape
            tool_masks = gather_lists([[int(x) for x in row[:len(ids_)]] for row, ids_ in
                                       zip(ro.tool_mask.tolist(), ro.completion_ids())], self.dp_group)
            completions = [conversation(self.tokenizer, row, mask) for row, mask in zip(ids, tool_masks)]
        columns = {k: [v[i] for i in prompt_of_row] for k, v in self.data.columns.items()}
        rewards_NF = score(self.rewards, prompts, completions, {**columns, "completion_ids": ids}, prompt_of_row)
        return ro, rewards_NF, lo * rl.group_size, texts, prompt_of_row


def refill(sampler: Sampler, model, ro: Rollout, advantages_N, rewards_N, weights, world) -> tuple:
    """DAPO's dynamic sampling on this rank: its groups whose rewards are all equal (no advantage, no gradient)
    are replaced by groups of fresh draws with unequal rewards, from up to rl.max_resample more rollouts (all
    ranks roll out together while any rank still lacks groups); groups still missing stay as they were."""
    G, rl = sampler.rl.group_size, sampler.rl
    want = ro.tokens.shape[0] // G

    def split(part: Rollout, adv_N, first_row: int, rewards_all):
        mine = rewards_all[first_row:first_row + part.tokens.shape[0]].view(-1, G)
        live = (mine.std(dim=1) > 0).repeat_interleave(G)
        return part.select(live.nonzero().squeeze(1)), adv_N[live], part.select((~live).nonzero().squeeze(1)), \
            adv_N[~live]

    kept, kept_adv, dropped, dropped_adv = split(ro, advantages_N, sampler.dp_rank * want * G, rewards_N)
    parts, advs = [kept], [kept_adv]
    have = kept.tokens.shape[0] // G
    for _ in range(rl.max_resample):
        if not all_reduce(torch.tensor(float(want - min(have, want))), world, dist.ReduceOp.MAX):
            break
        new, rewards_NF, first_row, _, _ = sampler.sample(model)
        total = rewards_NF @ weights
        new_adv = group_advantages(total, G, rl.advantage_std_norm)[first_row:first_row + new.tokens.shape[0]]
        good, good_adv, _, _ = split(new, new_adv, first_row, total)
        take = min(want - have, good.tokens.shape[0] // G) * G if have < want else 0
        parts.append(good.select(slice(0, take)))
        advs.append(good_adv[:take])
        have += take // G
    short = (want - have) * G
    parts.append(dropped.select(slice(0, short)))
    advs.append(dropped_adv[:short])
    parts = [p for p in parts if p.tokens.shape[0] > 0]
    return concat(parts, sampler.pad_id), torch.cat(advs)


def _differences(train_NC, rollout_NC, mask_NC) -> torch.Tensor:
    """[max, sum, count] of |training forward − rollout| over the completion tokens."""
    diff_NC = (train_NC - rollout_NC).abs() * mask_NC
    return torch.stack([diff_NC.max(), diff_NC.sum(), mask_NC.sum()]).cpu()


def recomputed_logprobs(model, ro: Rollout, temperature: float, autocast, replay: bool) -> torch.Tensor:
    """rl.old_logprobs=recompute: the training forward's log-probabilities of the rollout's completions before the
    update (the MoE routes replayed as in the update)."""
    routes = replay_routes(model, ro.routes, impose=replay) if ro.routes is not None else contextlib.nullcontext()
    with torch.no_grad(), routes, autocast:
        return completion_logprobs(model, ro, temperature)[0]


def rl_update(pm, ro: Rollout, advantages_N, ref_NC, optimizer, cfg, dp_group, world, autocast, replay: bool) -> dict:
    """rl.ppo_epochs x rl.mini_batches optimizer steps on this rank's rows (each skipped where its loss or gradient
    is not finite); returns the step's metrics and "finite": whether every update was."""
    rl, model = cfg.rl, pm.module
    N = ro.tokens.shape[0]
    temperature = float(policy_temperature(Sampling(temperature=float(rl.temperature))))
    totals = torch.zeros(5)  # loss, KL sum, clipped tokens, tokens, entropy sum
    route_counts, grad_norms = torch.zeros(2, dtype=torch.long), []  # MoE routes changed, replayed
    old_NC = ro.logprobs
    if rl.old_logprobs == "recompute":
        old_NC = recomputed_logprobs(model, ro, temperature, autocast, replay)
    weights_NC, mask_NC, corrected = rollout_correction(old_NC, ro.logprobs, ro.completion_mask,
                                                        rl.rollout_correction, rl.rollout_correction_threshold)
    diff = torch.zeros(3)  # max |training forward - rollout|, its sum, completion tokens
    if rl.old_logprobs == "recompute":
        diff = _differences(old_NC, ro.logprobs, ro.completion_mask)
    for epoch in range(rl.ppo_epochs):
        for m in range(rl.mini_batches):
            # every mini_batches-th row: the mini-batch is the same set of rows whatever the data-parallel split
            rows = torch.arange(m, N, rl.mini_batches)
            part = ro.select(rows)
            counts = all_reduce(torch.tensor([float(len(rows)), float(mask_NC[rows].sum())]), dp_group)
            routes = replay_routes(model, part.routes, impose=replay) if part.routes is not None \
                else contextlib.nullcontext([])
            with routes as tapes:
                with autocast:
                    logprobs, entropy = completion_logprobs(model, part, temperature)
                loss, stats = policy_loss(logprobs, old_NC[rows], None if ref_NC is None else ref_NC[rows],
                                          advantages_N[rows], mask_NC[rows], rl, counts[0], counts[1],
                                          weights_NC[rows])
                loss.backward()
            if epoch == 0 and m == 0 and rl.old_logprobs == "rollout":  # before any update: the rollout's policy
                diff = _differences(logprobs.detach(), part.logprobs, part.completion_mask)
            for t in tapes:
                route_counts += torch.stack([t.changed, t.replayed]).cpu()
            grad_norm, _ = optimizer_update(pm, optimizer, cfg, loss.item())
            grad_norms.append(grad_norm.item())
            entropy_sum = (entropy * mask_NC[rows]).sum().detach().reshape(1)
            totals += torch.cat([loss.detach().reshape(1), stats.detach(), entropy_sum]).cpu()
    all_reduce(totals, dp_group)  # the same on every rank, so all of them count a bad step alike
    diff_max = all_reduce(diff[:1].clone(), world, dist.ReduceOp.MAX)
    diff_sum = all_reduce(torch.cat([diff[1:], corrected.reshape(1).cpu(), ro.completion_mask.sum().reshape(1).cpu()]),
                          dp_group)
    all_reduce(route_counts, dp_group)
    updates = rl.ppo_epochs * rl.mini_batches
    tokens = float(totals[3])
    out = {"loss": float(totals[0]) / updates, "grad_norm": sum(grad_norms) / len(grad_norms),
           "rl/kl": float(totals[1]) / tokens, "rl/clip_frac": float(totals[2]) / tokens,
           "rl/entropy": float(totals[4]) / tokens, "rl/logprob_diff": float(diff_max),
           "rl/logprob_diff_mean": float(diff_sum[0] / diff_sum[1]),
           "rl/rollout_is_clip_frac": float(diff_sum[2] / diff_sum[3]),
           "finite": math.isfinite(float(totals[0])) and all(math.isfinite(g) for g in grad_norms)}
    if ro.routes is not None:
        # measured in the update's forwards: their routes against the rollout's
        out["rl/changed_routes"], out["rl/replayed_routes"] = (int(n) for n in route_counts)
    return out


def reference_logprobs(pm, reference, ro: Rollout, cfg, autocast):
    """The reference policy's log-probabilities of the rollout's completions (None when rl.kl_coef = 0)."""
    if cfg.rl.kl_coef == 0.0:
        return None
    temperature = policy_temperature(Sampling(temperature=float(cfg.rl.temperature)))
    model = pm.module if reference is None else reference
    with torch.no_grad(), autocast, adapters_disabled() if reference is None else contextlib.nullcontext():
        logprobs, _ = completion_logprobs(model, ro, temperature)
    return logprobs


SILENT_STEPS = 3  # a run whose first this-many steps carry no advantage at all says so (once)


def silent_start_notice(steps: int) -> str:
    """The one line of a run whose first `steps` steps had no group with unequal rewards."""
    return (f"rl: every group's rewards were equal in the first {steps} step(s) (rl/zero_adv_groups=1), so every "
            "advantage is 0 and loss, grad_norm and KL stay 0: nothing is learned. Start from a model that solves "
            "some prompts (docs/tasks/grpo.md#demo: task=sft ..., then task=grpo checkpoint.load=<that run>/"
            "checkpoints ...) or give rl.rewards that tell completions apart")


def run(cfg, rt: Runtime) -> None:
    """task=grpo: train the policy on the prompts of data.input with the rewards of rl.rewards."""
    rl, t, ck = cfg.rl, cfg.train, cfg.checkpoint
    _, _, dp_group = rt.dims.coords("dp")
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.trust_remote_code)
    data = read_prompts(cfg, tokenizer)
    rewards = build_rewards(rl)
    reference = None
    if rl.kl_coef != 0.0 and cfg.finetune.name == "full":  # else the policy with its adapters off
        reference = frozen_reference(cfg, rt)
    seed_everything(cfg.seed)
    order = PromptOrder(len(data.ids), cfg.seed)
    pm, optimizer, scheduler, _, autocast, step, _ = build_training(cfg, rt, loader=order)
    model = pm.module
    replay = bool(model.has_moe and (rl.router_replay is None or rl.router_replay))
    sampler = Sampler(cfg, rt, data, tokenizer, rewards, order, autocast)
    world = dist.group.WORLD if rt.world_size > 1 else None
    logger, checkpointer, stop_at = training_loop(cfg, rt, step)
    last_saved = None
    bad = BadSteps(t.max_bad_steps)
    silent, first_step = 0, step  # steps in a row without any advantage, from this process's first

    def checkpoint() -> None:
        checkpointer.save(step, model, optimizer, extra_state(step, scheduler, order, rt.device), cfg)

    try:
        with Preemption() as preemption:
            while step < stop_at:
                lr = scheduler.get_last_lr()[0]
                began = start = time.perf_counter()
                ro, rewards_NF, first_row, texts, prompt_of_row = sampler.sample(model)
                rollout_s = time.perf_counter() - start
                weights = torch.tensor([w for _, _, w in rewards])
                total_N = rewards_NF @ weights
                advantages = group_advantages(total_N, rl.group_size, rl.advantage_std_norm)
                zero_groups = float((total_N.view(-1, rl.group_size).std(dim=1) == 0).float().mean())
                N = ro.tokens.shape[0]
                if rl.dynamic_sampling:
                    ro, advantages = refill(sampler, model, ro, advantages[first_row:first_row + N], total_N,
                                            weights, world)
                else:
                    advantages = advantages[first_row:first_row + N]
                lengths = torch.tensor([float(len(x)) for x in gather_lists(ro.completion_ids(), dp_group)])
                # the groups the update trains on that carry no advantage (dynamic sampling replaces them)
                flat = (advantages.view(-1, rl.group_size) == 0).all(dim=1)
                flat_groups = all_reduce(torch.tensor([float(flat.sum()), float(flat.numel())]), dp_group)
                start = time.perf_counter()
                ref = reference_logprobs(pm, reference, ro, cfg, autocast)
                metrics = rl_update(pm, ro, advantages.to(rt.device), ref, optimizer, cfg, dp_group, world,
                                    autocast, replay)
                update_s = time.perf_counter() - start
                scheduler.step()
                step += 1
                bad.record(metrics.pop("finite"), step)
                if step - first_step <= SILENT_STEPS:  # every rank alike: the collective is matched
                    silent += not all_reduce(torch.tensor(float(bool(advantages.any()))), dp_group, dist.ReduceOp.MAX)
                logger.advance(step)
                tokens = float(lengths.sum())
                metrics |= {"rl/reward": float(total_N.mean()),
                            **{f"rl/reward/{name}": float(rewards_NF[:, f].mean())
                               for f, (name, _, _) in enumerate(rewards)},
                            "rl/response_len": float(lengths.mean()), "rl/response_len_max": float(lengths.max()),
                            "rl/clipped_share": float((lengths >= rl.max_new_tokens).float().mean()),
                            "rl/zero_adv_groups": zero_groups,
                            "rl/zero_adv_groups_trained": float(flat_groups[0] / flat_groups[1]),
                            "rl/rollout_tokens_per_s": tokens / rollout_s,
                            "rl/update_tokens_per_s": tokens * rl.ppo_epochs / update_s,
                            "rl/step_s": time.perf_counter() - began, "lr": lr, "skipped_steps": bad.total}
                if sampler.tools is not None:  # this step's tool calls and failed ones, all ranks
                    calls = all_reduce(torch.tensor([float(sampler.tools.calls), float(sampler.tools.errors)]),
                                       dp_group)
                    sampler.tools.calls = sampler.tools.errors = 0
                    metrics |= {"rl/tool_calls": float(calls[0]), "rl/tool_errors": float(calls[1])}
                logger.log(step, metrics)
                if silent == step - first_step == min(SILENT_STEPS, stop_at - first_step):
                    logger.message(silent_start_notice(silent))
                if step % t.log_every == 0 or step == stop_at:
                    for row in range(0, min(rl.num_samples * rl.group_size, len(texts)), rl.group_size):
                        logger.message(f"  sample (prompt {prompt_of_row[row]}, reward {float(total_N[row]):.3g}): "
                                       f"{texts[row]!r}")
                if ck.every > 0 and step % ck.every == 0 and bad.in_a_row == 0:  # never save a suspect state
                    checkpoint()
                    last_saved = step
                if preemption.any_rank(rt.device):
                    logger.message(f"SIGTERM: saving a checkpoint at step {step} and exiting")
                    break
        if last_saved != step and (ck.save_final or step < t.steps):
            checkpoint()
        checkpointer.close()
    finally:
        logger.close()


# ------------------------------------------------------------------ what task=grpo declares (speedllm.planner.spec)

VALUES = {
    "rl.group_size": ((lambda v: v >= 2), ">= 2 (with 1 every advantage would be zero: a reward minus the mean of "
                                          "its own group)"),
    **{f"rl.{k}": at_least(1) for k in ("prompts_per_step", "max_new_tokens", "ppo_epochs", "mini_batches")},
    **{f"rl.{k}": at_least(0) for k in ("overlong_buffer", "max_resample", "kl_coef", "clip_high",
                                         "overlong_penalty", "max_turns")},
    "rl.temperature": above(0),
    "rl.top_p": ((lambda v: 0 < v <= 1), "in (0, 1]"),
    "rl.clip_low": ((lambda v: 0 <= v < 1), "in [0, 1)"),
    "rl.rollout_correction_threshold": above(1),
    "rl.tool_timeout_s": above(0),
    "rl.tool_max_chars": above(0),
}


def layout_errors(run, layout, frozen=None) -> List[str]:
    rl = run.rl
    return grpo_layout_errors(pp=layout.pp, cp=layout.cp, tp=layout.tp, dp=layout.dp,
                              prompts_per_step=rl.prompts_per_step, group_size=rl.group_size,
                              mini_batches=rl.mini_batches, num_experts=run.model.num_experts,
                              router_replay=rl.router_replay)


def check_inputs(cfg) -> None:
    """The rl settings against each other, the reward functions and tools, and the prompts (read and tokenized
    here, so a bad record stops the run before any rank starts)."""
    rl = cfg.rl
    if rl.router_replay and not cfg.model.num_experts:
        raise UserError(f"rl.router_replay=true: model {cfg.model.name} has no experts; leave rl.router_replay unset")
    if rl.rollout_correction != "none" and rl.old_logprobs != "recompute":
        raise UserError(f"rl.rollout_correction={rl.rollout_correction} weighs the training forward's old "
                        "log-probabilities against the rollout's; add rl.old_logprobs=recompute")
    if rl.overlong_buffer > rl.max_new_tokens:
        raise UserError(f"rl.overlong_buffer={rl.overlong_buffer} exceeds rl.max_new_tokens={rl.max_new_tokens}; "
                        "use a smaller buffer")
    if not rl.rewards:
        raise UserError("task=grpo needs reward functions: rl.rewards=[{_target_: module.fn, weight: 1.0}]")
    for key, i, entry in [("rewards", i, e) for i, e in enumerate(rl.rewards)] + \
            [("tools", i, e) for i, e in enumerate(rl.tools)]:
        if not OmegaConf.is_dict(entry) or "_target_" not in entry:
            raise UserError(f"rl.{key}[{i}]={entry} needs _target_: module.fn"
                            + (" (and optionally weight)" if key == "rewards" else ""))
        try:
            get_method(entry["_target_"])
        except Exception as e:  # hydra wraps import and attribute errors alike
            raise UserError(f"rl.{key}[{i}]._target_={entry['_target_']} cannot be imported "
                            f"({str(e).splitlines()[0]}); name a function module.fn on the Python path") from None
        weight = entry.get("weight", 1.0)
        if key == "rewards" and not (isinstance(weight, numbers.Real) and math.isfinite(weight)):
            raise UserError(f"rl.rewards[{i}].weight={weight} must be a finite number")
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.trust_remote_code)
    if rl.tools and tokenizer.convert_tokens_to_ids("</tool_call>") in (None, tokenizer.unk_token_id):
        raise UserError(f"rl.tools: the tokenizer {cfg.data.tokenizer} has no </tool_call> token to end a call; use a "
                        "Qwen3 tokenizer or leave rl.tools empty")
    read_prompts(cfg, tokenizer)


def read_prompts(cfg, tokenizer=None):
    """data.input's prompts, tokenized (each must leave rl.max_new_tokens positions free)."""
    if cfg.data.input is None:
        raise UserError("task=grpo needs data.input=<json/jsonl of {prompt, ...} records> (or data=rl_demo)")
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.trust_remote_code)
    return load_prompts(cfg.data.input, tokenizer, max_positions(cfg.model) - cfg.rl.max_new_tokens,
                        cfg.rl.max_new_tokens, tool_schemas(build_tools(cfg.rl.tools)))


def workload(run) -> tuple:
    """A step trains on every completion: rl.prompts_per_step x rl.group_size rows of the longest prompt plus
    rl.max_new_tokens (the rollout left-pads its prompts to the widest and samples up to max_new_tokens)."""
    if run.data.input is None:
        read_prompts(run)  # raises its one line
    files = tuple((path, os.stat(path).st_mtime_ns) for path in expand_inputs(run.data.input))
    longest = _longest_prompt(files, str(run.data.tokenizer), run.data.trust_remote_code,
                              max_positions(run.model), run.rl.max_new_tokens)
    return longest + run.rl.max_new_tokens, run.rl.prompts_per_step * run.rl.group_size


@functools.lru_cache(maxsize=8)  # planning asks once per problem; a file's key holds its modification time
def _longest_prompt(files: tuple, tokenizer: str, trust_remote_code: bool, positions: int, max_new_tokens: int) -> int:
    prompts = load_prompts([path for path, _ in files], load_tokenizer(tokenizer, trust_remote_code),
                           positions - max_new_tokens, max_new_tokens)
    return max(map(len, prompts.ids))


def micro_batch(run, dp: int) -> int:
    """Each update runs on one mini-batch of the rank's completions at once (no accumulation)."""
    return max(1, run.rl.prompts_per_step // dp * run.rl.group_size // run.rl.mini_batches)


def frozen_model(run):
    """The reference: a frozen copy of the model with rl.kl_coef and full fine-tuning (LoRA turns its adapters off
    instead)."""
    return run.model if run.rl.kl_coef != 0 and run.finetune.name == "full" else None


def memory(run, frozen, rank) -> dict:
    """The reference's weights; the rollout's KV cache for this rank's completions; and the update's full-vocabulary
    logits of one mini-batch's completion positions with their float32 log-softmax and its gradient
    (speedllm.generation.rollout.completion_logprobs, not chunked)."""
    m, lay = run.model, rank.layout
    rows = run.rl.prompts_per_step * run.rl.group_size
    e = DTYPES[rank.hardware.dtype].itemsize
    # the logits in the compute dtype, then float32: their scaled copy, the log-softmax (kept) and its gradient
    logits = lay.micro_batch * run.rl.max_new_tokens * m.vocab_size * (e + 3 * 4)
    out = {"rollout": rollout_cache_bytes(m, lay, rows, rank.seq_len, rank.hardware.dtype), "logits": logits}
    if frozen is not None:
        out["teacher"] = teacher_bytes(frozen, lay, rank.hardware.dtype)
    return out


def extra_seconds(run, frozen, rank) -> float:
    """The rollout (a prefill of the prompts, then rl.max_new_tokens decode steps); the forwards without backward
    over every row (the reference's with rl.kl_coef, the old policy's with rl.old_logprobs=recompute); and the
    update's passes after the first (rl.ppo_epochs, a forward and backward: three forwards' work)."""
    m, lay, rl = run.model, rank.layout, run.rl
    rows = rl.prompts_per_step * rl.group_size
    prompt = rank.seq_len - rl.max_new_tokens
    cache = rollout_cache_bytes(m, lay, rows, rank.seq_len, rank.hardware.dtype)
    seconds = forward_seconds(m, lay, rank.hardware, rows * prompt, prompt, rank.efficiency)
    seconds += decode_seconds(lay, rank.hardware, rank.params, rl.max_new_tokens, cache)
    forwards = (rl.kl_coef != 0) + (rl.old_logprobs == "recompute") + 3 * (rl.ppo_epochs - 1)
    return seconds + forwards * forward_seconds(m, lay, rank.hardware, rows * rank.seq_len, rank.seq_len,
                                                rank.efficiency)


SPEC = TaskSpec(layout_errors=layout_errors, values=VALUES, inputs=check_inputs, train_batches=False,
                workload=workload, micro_batch=micro_batch, memory=memory, frozen_model=frozen_model,
                extra_seconds=extra_seconds, workload_keys="rl.prompts_per_step, rl.group_size, rl.max_new_tokens",
                batch_invariant=lambda run: True)
