"""Rollouts for reinforcement learning (task=grpo) and on-policy distillation: the training model itself, under its
training layout, samples `n` completions per prompt through the KV cache and records what an update needs.

No copy of the weights and no weight sync: `rollout` runs the very modules the optimizer steps (FSDP, TP, EP as
built), in no_grad, then `completion_logprobs` is the training forward over the same tokens.

A Rollout's layout (rows prompt-major: row i*n + j is completion j of prompt i):
    tokens        [N, P + C]  each prompt left-padded to P (the longest prompt), its completion from column P on,
                              right-padded with pad_id after its stop token (kept) or at column P + C
    attention_mask[N, P + C]  1 = a prompt or completion token, 0 = padding (left or right)
    position_ids  [N, P + C]  RoPE positions counted from each prompt's first token
    prompt_lens   [N]         real prompt tokens per row
    completion_mask [N, C]    1.0 = a completion token (the stop token included), float32
    logprobs      [N, C]      float32 log-probability of each sampled token under softmax(logits / temperature)
                              (temperature 1 when greedy; top-p / top-k filtering is not part of it, as in TRL),
                              0 where masked. Taken from the decode step's logits; `completion_logprobs` on the
                              same tokens gives the same values (float32: within ~1e-6)
    truncated     [N]         bool: the row reached max_new_tokens without a stop token
    routes        [L, N, P + C, k] or None   for MoE models the experts each token used in each of the L MoE
                              layers (-1 where no forward saw the token: the last column); pass to
                              speedllm.models.moe.replay_routes around the training forward (router replay)
    tool_mask     [N, C] or None  with tools (speedllm.train.tools.ToolRunner): 1.0 = a tool-response token the
                              rollout appended (attended, but 0 in completion_mask and logprobs: no loss)

Sampling is reproducible per prompt: prompt i draws from its own generators[i], so its completions do not
depend on which other prompts share the batch or the rank (a data-parallel split samples what one process does).

Letters: N rows (prompts x n), P padded prompt length, C completion columns, V vocabulary, L MoE layers,
k experts per token.
"""

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from speedllm.generation.engine import keep_positions, last_position_only, left_pad, new_cache
from speedllm.generation.sampling import Sampling, draw, process_logits
from speedllm.models.moe import record_routes


@dataclass
class Rollout:
    tokens: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_lens: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    truncated: torch.Tensor
    routes: Optional[torch.Tensor] = None
    tool_mask: Optional[torch.Tensor] = None

    @property
    def prompt_width(self) -> int:
        """P: the column where completions start."""
        return self.tokens.shape[1] - self.completion_mask.shape[1]

    def completion_ids(self) -> List[List[int]]:
        """Each row's completion token ids (its stop token included)."""
        lengths = self.live_mask().sum(dim=1).long().tolist()
        return [row[:n] for row, n in zip(self.tokens[:, self.prompt_width:].tolist(), lengths)]

    def live_mask(self) -> torch.Tensor:
        """[N, C] 1.0 = a completion column holding a token (sampled or a tool's)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask + self.tool_mask

    def select(self, rows) -> "Rollout":
        """The rows `rows` (an index tensor, list or slice) as a Rollout of their own."""
        routes = None if self.routes is None else self.routes[:, rows]
        tool_mask = None if self.tool_mask is None else self.tool_mask[rows]
        return Rollout(self.tokens[rows], self.attention_mask[rows], self.position_ids[rows], self.prompt_lens[rows],
                       self.completion_mask[rows], self.logprobs[rows], self.truncated[rows], routes, tool_mask)


def policy_temperature(sampling: Sampling) -> float:
    """The temperature of the distribution whose log-probabilities a rollout records (1 when greedy)."""
    return sampling.temperature if not sampling.greedy else 1.0


def token_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor, temperature: float, entropy: bool = True) -> tuple:
    """(log-probability of tokens_N, entropy or None) under softmax(logits / temperature), float32; the one formula
    the rollout and the training forward share. Entropy is detached (a metric; the rollout skips it: its exp over
    the vocabulary costs a decode step more than sampling does)."""
    logp_NV = torch.log_softmax(logits_NV.float() / temperature, dim=-1)
    entropy_N = None
    if entropy:
        with torch.no_grad():
            entropy_N = -(logp_NV.exp() * logp_NV).sum(dim=-1)
    return logp_NV.gather(-1, tokens_N.unsqueeze(-1)).squeeze(-1), entropy_N


def _draw(logits_NV, sampling: Sampling, generators, n: int) -> torch.Tensor:
    if sampling.greedy:
        return logits_NV.argmax(dim=-1)
    probs_NV = torch.softmax(process_logits(logits_NV, sampling, None), dim=-1)
    return torch.cat([draw(probs_NV[i * n:(i + 1) * n], g) for i, g in enumerate(generators)])


def _all_done(done_N: torch.Tensor, group) -> bool:
    """Whether every row of every rank in `group` has finished (the ranks' forwards are collective)."""
    if group is None:
        return bool(done_N.all())
    flag = done_N.all().to(torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag)


def draw_generators(seed: int, draws: Sequence[int], device, *stream: int) -> List[torch.Generator]:
    """One sampling generator per prompt, seeded by (seed, the prompt's draw, *stream) alone: a draw is the prompt's
    index in the run (GRPO: its place in the prompt order; on-policy distillation: its sample index in the data), so
    its completions do not depend on the layout, the rank that samples it, or what shares its batch."""
    return [torch.Generator(device=device).manual_seed(
        int(np.random.SeedSequence([seed, draw, *stream]).generate_state(1, np.uint64)[0] >> 1)) for draw in draws]


@torch.no_grad()
def rollout(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    n: int,
    max_new_tokens: int,
    sampling: Sampling,
    generators: Optional[Sequence[torch.Generator]],
    stop_ids: Sequence[int],
    pad_id: int,
    dtype: torch.dtype,
    tp: int = 1,
    group=None,
    tools=None,
) -> Rollout:
    """Sample `n` completions of each prompt with `model` (batched, KV cache) and record them as a Rollout.

    Args:
        model: a Qwen3, possibly FSDP / tensor / expert parallel (the training model itself, in eval or train
            mode alike: the forward has no dropout).
        prompts: token ids of this rank's prompts; each prompt plus max_new_tokens must fit the model's positions.
        sampling: temperature / top_p / top_k (repetition_penalty is not applied).
        generators: one torch.Generator per prompt, on the model's device (None when greedy).
        stop_ids: token ids that end a completion (kept in it).
        dtype: activation dtype, for the KV cache.
        tp: tensor-parallel degree (the cache holds this rank's share of the kv heads).
        group: the process group whose ranks run these forwards together (their prompts may differ): decoding
            stops when all of them are done. None: this process alone (or ranks with the same prompts).
        tools: a speedllm.train.tools.ToolRunner, or None. A row that samples its `</tool_call>` (within
            tools.max_turns calls) gets the tool's response tokens next, one per decode step through the same
            cache (no re-tokenization), recorded with tool_mask 1 and no log-probability; after max_turns calls a
            `</tool_call>` ends the row.
    """
    cfg = model.cfg
    device = next(model.parameters()).device
    temperature = policy_temperature(sampling)
    rows = [list(p) for p in prompts for _ in range(n)]
    N = len(rows)
    tokens_NP, mask_NP, positions_NP = left_pad(rows, pad_id, device)
    P = tokens_NP.shape[1]
    cache = new_cache(cfg, N, P + max_new_tokens, dtype, device, tp)
    stop_t = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    out_NC = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs_NC = torch.zeros((N, max_new_tokens), dtype=torch.float32, device=device)
    live_NC = torch.zeros((N, max_new_tokens), dtype=torch.float32, device=device)
    done_N = torch.zeros(N, dtype=torch.bool, device=device)
    tool_NC = torch.zeros((N, max_new_tokens), dtype=torch.float32, device=device)
    queues = [[] for _ in range(N)]  # tool-response tokens each row feeds next
    turns = [0] * N
    padded = any(len(p) < P for p in rows)
    steps = 0
    with record_routes(model) if model.has_moe else contextlib.nullcontext([]) as tapes:
        with last_position_only(model):
            logits_NV = model(tokens_NP, position_ids=positions_NP, attention_mask=mask_NP if padded else None,
                              kv_cache=cache)[:, -1]
        position_N1 = positions_NP[:, -1:]
        for step in range(max_new_tokens):
            token_N = torch.where(done_N, pad_id, _draw(logits_NV, sampling, generators, n))
            forced_N = torch.zeros(N, dtype=torch.bool, device=device)
            if tools is not None:
                forced = [r for r in range(N) if queues[r]]
                if forced:
                    forced_N[forced] = True
                    token_N[forced] = torch.tensor([queues[r].pop(0) for r in forced], device=device)
            logprob_N, _ = token_logprobs(logits_NV, token_N, temperature, entropy=False)
            sampled_N = ~done_N & ~forced_N
            live_NC[:, step] = sampled_N.float()
            tool_NC[:, step] = forced_N.float()
            logprobs_NC[:, step] = torch.where(sampled_N, logprob_N, 0.0)
            out_NC[:, step] = token_N
            done_N |= torch.isin(token_N, stop_t) & sampled_N
            if tools is not None:
                calls = (sampled_N & (token_N == tools.end_id)).nonzero().flatten().tolist()
                done_N[[r for r in calls if turns[r] == tools.max_turns]] = True
                calls = [r for r in calls if turns[r] < tools.max_turns]
                for r, response in zip(calls, tools.respond([out_NC[r, :step + 1].tolist() for r in calls])):
                    turns[r] += 1
                    queues[r] = response
            steps = step + 1
            if steps == max_new_tokens or _all_done(done_N, group):
                break
            position_N1 = position_N1 + 1
            logits_NV = model(token_N[:, None], position_ids=position_N1, kv_cache=cache)[:, -1]

    completion_mask = live_NC[:, :steps]
    tool_mask = tool_NC[:, :steps] if tools is not None else None
    attention_mask = torch.cat([mask_NP, (completion_mask + tool_NC[:, :steps]).long()], dim=1)
    completion_positions = mask_NP.sum(dim=1, keepdim=True) + torch.arange(steps, device=device)
    routes = None
    if tapes:
        # the last column was sampled but never fed through the model: no route
        last = torch.full((N, 1, cfg.num_experts_per_tok), -1, dtype=torch.long, device=device)
        routes = torch.stack([torch.cat([*tape.recorded, last], dim=1) for tape in tapes])
    return Rollout(
        tokens=torch.cat([tokens_NP, out_NC[:, :steps]], dim=1),
        attention_mask=attention_mask,
        position_ids=torch.cat([positions_NP, completion_positions], dim=1),
        prompt_lens=mask_NP.sum(dim=1),
        completion_mask=completion_mask,
        logprobs=logprobs_NC[:, :steps],
        truncated=~done_N,
        routes=routes,
        tool_mask=tool_mask,
    )


def completion_logprobs(model: nn.Module, ro: Rollout, temperature: float) -> tuple:
    """The training forward of a rollout's rows: (log-probabilities [N, C] of its completion tokens, with gradient,
    entropy [N, C] detached), float32, 0 where completion_mask is 0. Only the completion positions reach the
    output projection. For router replay, call it inside speedllm.models.moe.replay_routes(model, ro.routes)."""
    P, C = ro.prompt_width, ro.completion_mask.shape[1]
    with keep_positions(model, slice(P - 1, P + C - 1)):
        logits_NCV = model(ro.tokens, position_ids=ro.position_ids, attention_mask=ro.attention_mask)
    logprobs_NC, entropy_NC = token_logprobs(logits_NCV, ro.tokens[:, P:], temperature)
    return logprobs_NC * ro.completion_mask, entropy_NC * ro.completion_mask


def concat(parts: Sequence[Rollout], pad_id: int) -> Rollout:
    """The rows of several rollouts as one: prompts left-padded to the widest, completions right-padded."""
    P = max(p.prompt_width for p in parts)
    C = max(p.completion_mask.shape[1] for p in parts)

    def widen(x, left: int, right: int, value):
        return torch.nn.functional.pad(x, (left, right), value=value)

    out = []
    for p in parts:
        left, right = P - p.prompt_width, C - p.completion_mask.shape[1]
        routes = None
        if p.routes is not None:
            routes = torch.nn.functional.pad(p.routes, (0, 0, left, right), value=-1)
        out.append(Rollout(widen(p.tokens, left, right, pad_id), widen(p.attention_mask, left, right, 0),
                           widen(p.position_ids, left, right, 0), p.prompt_lens, widen(p.completion_mask, 0, right, 0),
                           widen(p.logprobs, 0, right, 0), p.truncated, routes,
                           None if p.tool_mask is None else widen(p.tool_mask, 0, right, 0)))
    routes = None if out[0].routes is None else torch.cat([o.routes for o in out], dim=1)
    tool_mask = None if out[0].tool_mask is None else torch.cat([o.tool_mask for o in out])
    return Rollout(*(torch.cat([getattr(o, f) for o in out]) for f in
                     ("tokens", "attention_mask", "position_ids", "prompt_lens", "completion_mask", "logprobs",
                      "truncated")), routes, tool_mask)
