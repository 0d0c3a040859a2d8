"""Continuous batching: requests join and leave the running batch between decode steps.

Every running request owns one row of a SlotCache at its own length. A step is a `Step` value: row moves
(finished requests leave, the last rows fill their places), one decode token for each running row, then the
prefills of the requests joining in the free rows after them. `run_step` executes a step on one rank; the
`Batcher` (rank 0) plans the steps, picks every row's next token with its own sampling settings and stop
conditions, and under tensor parallelism hands each step to the other ranks (`serve_steps`) before running it.

Letters: B running rows, S prompt length, V vocabulary.
"""

import collections
import threading
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from speedllm.generation.engine import StopStrings, last_position_only
from speedllm.generation.sampling import Sampling, next_token
from speedllm.models.kv_cache import SlotCache, cache_shape


@dataclass
class Step:
    """One step of the running batch, the same on every rank."""

    moves: List[Tuple[int, int]] = field(default_factory=list)  # (src row, dst row), in order
    decode: List[int] = field(default_factory=list)  # input token of rows 0..len-1
    prefills: List[List[int]] = field(default_factory=list)  # prompts of rows len(decode), len(decode)+1, …


def new_slot_cache(model_cfg, num_slots: int, max_len: int, dtype, device, tp: int = 1) -> SlotCache:
    """A slot cache for `num_slots` sequences of up to `max_len` tokens; a TP rank holds kv_heads / tp."""
    return SlotCache(cache_shape(model_cfg, tp), num_slots, max_len, dtype, device)


@torch.no_grad()
def run_step(model: nn.Module, cache: SlotCache, step: Step) -> Optional[torch.Tensor]:
    """Apply a step to the model and cache: logits_BV of the next token of every row it ran (None if none)."""
    device = cache.k.device
    for src, dst in step.moves:
        cache.move(src, dst)
    logits = []
    num_decode = len(step.decode)
    if num_decode:
        cache.select(0, num_decode, 1)
        tokens_B1 = torch.tensor(step.decode, dtype=torch.long, device=device)[:, None]
        logits.append(model(tokens_B1, kv_cache=cache)[:, -1])
    for i, prompt in enumerate(step.prefills):
        row = num_decode + i
        cache.clear(row)
        cache.select(row, row + 1, len(prompt))
        with last_position_only(model):
            logits.append(model(torch.tensor([prompt], dtype=torch.long, device=device), kv_cache=cache)[:, -1])
    return torch.cat(logits) if logits else None


@dataclass(eq=False)
class Request:
    """One completion. `on_event` is called from the batcher's thread with each new token id, then with None
    once the request has finished (`finish_reason` set); it must not block.

    Args:
        max_new_tokens: the most tokens to generate (the stop token, when one ends it, included).
        seed: seeds this request's own sampling generator, so its draws do not depend on its batch mates.
        stop: strings that end the completion once its text contains one.
    """

    prompt_ids: List[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    on_event: Callable[[Optional[int]], None] = lambda token: None
    out_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled"
    cancelled: bool = False  # set by the client's side (it went away); the batcher drops it before the next step
    generator: Optional[torch.Generator] = None
    stop_strings: Optional[StopStrings] = None


class QueueFull(Exception):
    """More requests are waiting than serve.max_queue allows."""


class Batcher:
    """Rank 0's scheduler: admits waiting requests into free rows, runs steps, picks tokens, ends requests.

    Args:
        max_batch: rows of the slot cache (requests decoded together).
        max_len: tokens per row (prompt + completion).
        max_queue: requests allowed to wait for a row; `submit` raises QueueFull beyond it.
        broadcast: hand every step to the other ranks first (tensor parallelism; they run `serve_steps`).
    """

    def __init__(self, model: nn.Module, tokenizer, stop_ids: Sequence[int], max_batch: int, max_len: int,
                 max_queue: int, dtype: torch.dtype, tp: int = 1, broadcast: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.stop_ids = set(stop_ids)
        self.max_batch, self.max_len, self.max_queue = max_batch, max_len, max_queue
        self.cache = new_slot_cache(model.cfg, max_batch, max_len, dtype, self.device, tp)
        self.broadcast = broadcast
        self.rows: List[Request] = []  # rows[i] runs in cache row i
        self.pending: List[int] = []  # the next input token of each row
        self._waiting: Deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False

    # ----------------------------------------------------------------- any thread
    def submit(self, requests: List[Request]) -> None:
        """Queue requests, all or none (QueueFull when more than max_queue would be waiting)."""
        for request in requests:
            if not request.sampling.greedy:
                request.generator = torch.Generator(device=self.device)
                if request.seed is None:
                    request.generator.seed()
                else:
                    request.generator.manual_seed(request.seed)
            if request.stop:
                request.stop_strings = StopStrings(self.tokenizer, request.stop)
        with self._cond:
            if len(self._waiting) + len(requests) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (serve.max_queue={self.max_queue})")
            self._waiting.extend(requests)
            self._cond.notify()

    def stop(self) -> None:
        """Make `run` return after the current step (waiting and running requests end as cancelled)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ----------------------------------------------------------------- the batcher's thread
    def run(self, idle_s: float = 30.0) -> None:
        """Serve until `stop`; with other ranks, an idle batcher sends them an empty step every idle_s (their
        collective would time out otherwise), and None at the end."""
        try:
            while True:
                with self._cond:
                    if not self.rows and not self._waiting and not self._stopping:
                        self._cond.wait(timeout=idle_s)
                    if self._stopping:
                        break
                    idle = not self.rows and not self._waiting
                if idle:
                    self._execute(Step())
                else:
                    self.step()
            if self.broadcast:
                dist.broadcast_object_list([None], src=0)
        finally:
            self._end_all()  # also when a step failed: no client waits forever

    def step(self) -> None:
        """One step: drop finished rows, admit waiting requests, run, choose and deliver the next tokens."""
        step = Step(moves=self._compact(), decode=list(self.pending))
        joining = self._admit()
        step.prefills = [r.prompt_ids for r in joining]
        self.rows += joining
        logits_BV = self._execute(step)
        if logits_BV is None:
            return
        self.pending = self._choose(logits_BV)
        for request, token in zip(self.rows, self.pending):
            request.out_ids.append(token)
            request.on_event(token)
            reason = self._finish_reason(request, token)
            if reason is not None:
                self._finish(request, reason)

    def _execute(self, step: Step) -> Optional[torch.Tensor]:
        if self.broadcast:
            dist.broadcast_object_list([step], src=0)
        return run_step(self.model, self.cache, step)

    def _admit(self) -> List[Request]:
        joining = []
        with self._cond:
            while self._waiting and len(self.rows) + len(joining) < self.max_batch:
                request = self._waiting.popleft()
                if request.cancelled:
                    self._finish(request, "cancelled")
                else:
                    joining.append(request)
        return joining

    def _compact(self) -> List[Tuple[int, int]]:
        """Remove finished and cancelled rows; the last running rows move into their places."""
        for request in self.rows:
            if request.cancelled and request.finish_reason is None:
                self._finish(request, "cancelled")
        rows, pending, moves = list(self.rows), list(self.pending), []
        i = 0
        while True:
            while rows and rows[-1].finish_reason is not None:
                rows.pop()
                pending.pop()
            if i >= len(rows):
                break
            if rows[i].finish_reason is not None:  # rows[-1] is running, so i is not the last row
                moves.append((len(rows) - 1, i))
                rows[i], pending[i] = rows.pop(), pending.pop()
            i += 1
        self.rows, self.pending = rows, pending
        return moves

    def _choose(self, logits_BV: torch.Tensor) -> List[int]:
        """Each row's next token: all greedy rows in one argmax, sampled rows with their own generator."""
        tokens_B = logits_BV.argmax(dim=-1)
        for b, request in enumerate(self.rows):
            if not request.sampling.greedy:
                tokens_B[b] = next_token(logits_BV[b:b + 1], request.sampling, None, request.generator)[0]
        return tokens_B.tolist()

    def _finish_reason(self, request: Request, token: int) -> Optional[str]:
        if token in self.stop_ids:
            return "stop"
        if request.stop_strings is not None and request.stop_strings.hit(request.out_ids):
            return "stop"
        if len(request.out_ids) >= request.max_new_tokens or \
                len(request.prompt_ids) + len(request.out_ids) >= self.max_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.on_event(None)

    def _end_all(self) -> None:
        with self._cond:
            left = self.rows + list(self._waiting)
            self._waiting.clear()
        for request in left:
            if request.finish_reason is None:
                self._finish(request, "cancelled")


def serve_steps(model: nn.Module, cache: SlotCache) -> None:
    """A tensor-parallel rank other than 0: run rank 0's steps until it sends None."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        run_step(model, cache, box[0])
