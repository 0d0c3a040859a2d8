"""Batched generation with a static KV cache: one prefill over the left-padded prompts, then one token per step.

Letters: B batch rows, S prompt length (padded), V vocabulary, N new tokens.

Per decode step the Python work is one model call, the token choice and writing into a preallocated
output buffer; the only host sync is the "all rows finished?" check (and, when asked for, streaming and
stop strings, which need the text anyway).
"""

import contextlib
from typing import Callable, List, Optional, Sequence

import torch
from torch import nn

from speedllm.generation.sampling import Sampling, next_token
from speedllm.models.kv_cache import KVCache, cache_shape
from speedllm.models.rope import max_positions


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device) -> tuple:
    """tokens_BS, attention_mask_BS (0 = padding) and RoPE position_ids_BS (0.. from each prompt's first token)."""
    S = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), S), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), S), dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, S - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, S - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return tokens.to(device), mask.to(device), positions.to(device)


def new_cache(model_cfg, batch: int, max_len: int, dtype, device, tp: int = 1) -> KVCache:
    """A cache for `batch` rows of up to `max_len` tokens; with tensor parallelism a rank holds heads / tp."""
    return KVCache(cache_shape(model_cfg, tp), batch, max_len, dtype, device)


@contextlib.contextmanager
def keep_positions(model: nn.Module, keep: slice):
    """Only positions `keep` reach the output projection (transformers' logits_to_keep): the final norm hands
    on just those, so the [B, S, V] logits of every position are never made. (A pipeline rank's model has no
    final norm of its own: it computes every position's logits.)"""
    if getattr(model, "norm", None) is None:
        yield
        return
    handle = model.norm.register_forward_hook(lambda module, args, out: out[:, keep])
    try:
        yield
    finally:
        handle.remove()


def last_position_only(model: nn.Module):
    """During the prefill only the last position's logits are needed."""
    return keep_positions(model, slice(-1, None))


class StopStrings:
    """Finds the first stop string in each row's decoded completion (only used when generate.stop is set)."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, list(stops)

    def hit(self, ids: List[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def cut(self, text: str) -> str:
        """The text up to (not including) the earliest stop string."""
        ends = [text.find(s) for s in self.stops if s in text]
        return text[: min(ends)] if ends else text


# no_grad rather than inference_mode: the model may be a training run's FSDP model, whose parameters must
# not become inference tensors.
@torch.no_grad()
def generate_ids(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Sequence[int],
    pad_id: int,
    dtype: torch.dtype,
    seed: int = 0,
    tp: int = 1,
    stop_strings: Optional[StopStrings] = None,
    on_token: Optional[Callable[[int], None]] = None,
) -> List[List[int]]:
    """New token ids for each prompt (a row ends at its first stop id, which is kept, or after max_new_tokens,
    or where the longest row reaches the model's max_positions).

    Args:
        model: a Qwen3 (possibly tensor-parallel or FSDP-wrapped), every rank calling with the same prompts.
        stop_ids: token ids that end a row (eos / end of turn).
        dtype: activation dtype, for the KV cache.
        seed: seeds the sampling generator (greedy ignores it); the same seed gives the same draws.
        tp: tensor-parallel degree (the cache holds this rank's share of the kv heads).
        stop_strings: also end a row once its decoded text contains one of these strings.
        on_token: called with each new token id of row 0 (streaming a single prompt).
    """
    cfg = model.cfg
    device = next(model.parameters()).device
    B = len(prompts)
    tokens_BS, mask_BS, positions_BS = left_pad(prompts, pad_id, device)
    max_new_tokens = max(0, min(max_new_tokens, max_positions(cfg) - tokens_BS.shape[1]))
    cache = new_cache(cfg, B, tokens_BS.shape[1] + max_new_tokens, dtype, device, tp)
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    seen_BV = None
    if sampling.repetition_penalty != 1.0:
        # the prompt's tokens, padding left out (transformers' processor also penalizes the pad token)
        seen_BV = torch.zeros(B, cfg.vocab_size, dtype=torch.long, device=device)
        seen_BV = seen_BV.scatter_add_(1, tokens_BS, mask_BS) > 0
    stop_t = torch.tensor(list(stop_ids), dtype=torch.long, device=device)
    out_BN = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    # Checking "all done?" costs a device sync; accelerators check every few steps to keep their queue full.
    check_every = 1 if device.type == "cpu" or stop_strings or on_token else 8

    padded = any(len(p) < tokens_BS.shape[1] for p in prompts)
    with last_position_only(model):
        # without padding the model can use plain causal attention (no mask tensor)
        logits_BV = model(tokens_BS, position_ids=positions_BS, attention_mask=mask_BS if padded else None,
                          kv_cache=cache)[:, -1]
    position_B1 = positions_BS[:, -1:]
    num_steps = 0
    for step in range(max_new_tokens):
        token_B = next_token(logits_BV, sampling, seen_BV, generator)
        token_B = torch.where(done_B, pad_id, token_B)
        out_BN[:, step] = token_B
        num_steps = step + 1
        if seen_BV is not None:
            seen_BV.scatter_(1, token_B[:, None], True)
        done_B |= torch.isin(token_B, stop_t)
        if on_token is not None:
            on_token(int(token_B[0]))
        if stop_strings is not None:
            rows = out_BN[:, :num_steps].tolist()
            for b in range(B):
                if not done_B[b] and stop_strings.hit(rows[b]):
                    done_B[b] = True
        if num_steps == max_new_tokens or (num_steps % check_every == 0 and bool(done_B.all())):
            break
        position_B1 = position_B1 + 1
        logits_BV = model(token_B[:, None], position_ids=position_B1, kv_cache=cache)[:, -1]

    rows = out_BN[:, :num_steps].tolist()
    stops = set(stop_ids)
    results = []
    for row in rows:
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        results.append(row[:end])
    return results


class Detokenizer:
    """A growing completion's text, released in final pieces: never a partial UTF-8 character, never the
    start of what may become a stop string; the text ends before the first stop string. Streams the text of
    task=generate / chat to the console and of task=serve to its clients."""

    def __init__(self, tokenizer, stop_ids, stops: List[str]):
        self.tokenizer, self.skip = tokenizer, set(stop_ids)
        self.stops = StopStrings(tokenizer, stops) if stops else None
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: List[int] = []
        self.sent = 0

    def text(self) -> str:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        return self.stops.cut(text) if self.stops else text

    def add(self, token: int) -> str:
        """The new final text after `token`."""
        if token in self.skip:
            return ""
        self.ids.append(token)
        text = self.text()
        end = len(text) - self.hold
        while end > self.sent and text[end - 1] == "\ufffd":
            end -= 1
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent += len(piece)
        return piece

    def extend(self, ids: List[int]) -> "Detokenizer":
        """Take tokens without releasing text (for a response sent whole)."""
        self.ids += [t for t in ids if t not in self.skip]
        return self

    def finish(self) -> str:
        """What is left once the completion has ended."""
        piece = self.text()[self.sent:]
        self.sent += len(piece)
        return piece
