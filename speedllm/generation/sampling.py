"""Choosing the next token from logits: greedy, or sampling with repetition penalty, temperature, top-k, top-p.

The order and the filtering rules are transformers' (RepetitionPenaltyLogitsProcessor, then the
Temperature, TopK and TopP warpers), so the same settings mean the same distribution in both.
Letters: B batch rows, V vocabulary.
"""

from dataclasses import dataclass
from typing import Optional

import torch

MIN_TEMPERATURE = 1e-6  # below it, logits / temperature can overflow float32 (a 0.0 in float32 is greedy's 0)


@dataclass(frozen=True)
class Sampling:
    """Decoding settings (generate.temperature 0 = greedy; top_k 0 and top_p 1 disable those filters)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_cfg(cls, gen) -> "Sampling":
        return cls(float(gen.temperature), int(gen.top_k), float(gen.top_p), float(gen.repetition_penalty))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits_BV: torch.Tensor, seen_BV: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make every token already in the sequence less likely: divide positive logits, multiply negative ones."""
    penalized = torch.where(logits_BV < 0, logits_BV * penalty, logits_BV / penalty)
    return torch.where(seen_BV, penalized, logits_BV)


def filter_top_k(logits_BV: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (ties with the k-th included), -inf elsewhere."""
    kth = torch.topk(logits_BV, min(k, logits_BV.shape[-1]))[0][..., -1:]
    return logits_BV.masked_fill(logits_BV < kth, float("-inf"))


def filter_top_p(logits_BV: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (at least one), -inf elsewhere."""
    sorted_logits, sorted_idx = torch.sort(logits_BV, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - p)
    remove_sorted[..., -1] = False
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    return logits_BV.masked_fill(remove, float("-inf"))


def process_logits(logits_BV: torch.Tensor, s: Sampling, seen_BV: Optional[torch.Tensor]) -> torch.Tensor:
    """The logits whose softmax is the sampling distribution (fp32)."""
    logits_BV = logits_BV.float()
    if s.repetition_penalty != 1.0 and seen_BV is not None:
        logits_BV = apply_repetition_penalty(logits_BV, seen_BV, s.repetition_penalty)
    if s.greedy:
        return logits_BV
    logits_BV = logits_BV / s.temperature
    if s.top_k > 0:
        logits_BV = filter_top_k(logits_BV, s.top_k)
    if s.top_p < 1.0:
        logits_BV = filter_top_p(logits_BV, s.top_p)
    return logits_BV


def draw(probs_BV: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """Token ids [B] drawn from the rows of probs_BV by inverting their cumulative sums at one uniform number per
    row. torch.multinomial draws an exponential number per vocabulary entry (V random numbers per row): on CPU at
    8192 entries that costs twice the output layer's matmul of a decode step. A token of probability 0 is never
    drawn (the search takes the first entry whose sum exceeds the number)."""
    cdf_BV = probs_BV.cumsum(dim=-1)
    u_B1 = torch.rand(probs_BV.shape[0], 1, generator=generator, device=probs_BV.device) * cdf_BV[:, -1:]
    return torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(1).clamp_(max=probs_BV.shape[-1] - 1)


def next_token(logits_BV: torch.Tensor, s: Sampling, seen_BV: Optional[torch.Tensor],
               generator: Optional[torch.Generator]) -> torch.Tensor:
    """Token ids [B]: the argmax when greedy, else a draw from the processed distribution with `generator`."""
    logits_BV = process_logits(logits_BV, s, seen_BV)
    if s.greedy:
        return logits_BV.argmax(dim=-1)
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
