"""Fault handling: preemption (SIGTERM) as a flag checked at step boundaries, and bad-step accounting."""

import signal
import threading

import torch
import torch.distributed as dist

from speedllm.errors import UserError


class Preemption:
    """Turns SIGTERM into a flag; the loop saves a checkpoint at the next step boundary and exits 0.

    Saving inside the signal handler would race the optimizer step and (with several ranks) the
    collectives, so the handler only records the request.
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame):
        self.requested = True

    def any_rank(self, device: torch.device) -> bool:
        """True if any rank got SIGTERM: every rank must stop at the same step to save together."""
        if not dist.is_initialized():
            return self.requested
        flag = torch.tensor([int(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class BadSteps:
    """Counts steps skipped for a non-finite loss or gradient; too many in a row stops the run."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0

    def record(self, ok: bool, step: int) -> None:
        """Account for one step; raise once `max_in_a_row` consecutive steps were bad."""
        if ok:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.max_in_a_row:
            raise UserError(
                f"train: {self.in_a_row} consecutive steps had a non-finite loss or gradient (last at step {step}); "
                f"stopped without checkpointing this state (train.max_bad_steps={self.max_in_a_row}). "
                "Lower optim.lr, raise optim.warmup_steps or set train.grad_clip, then resume from the last checkpoint")
