"""task=evaluate: loss, perplexity and tokens/s of any checkpoint over a dataset split; with evaluate.tasks,
lm-eval's task suites instead (speedllm.generation.harness).

    python launch.py task=evaluate checkpoint.load=outputs/<run>/checkpoints [evaluate.split=test evaluate.steps=50]
    python launch.py task=evaluate checkpoint.load=outputs/<run>/checkpoints evaluate.tasks=[hellaswag]

Reads evaluate.steps micro-batches (train.micro_batch_size x train.seq_len) of the split per data-parallel
rank, exactly as training's loader does, and reports exp(total cross-entropy / target tokens). The numbers
are printed and written to <run_dir>/eval.json.
"""

import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from speedllm.errors import UserError
from speedllm.generation.load import load_model
from speedllm.ops import IGNORE_INDEX
from speedllm.planner.spec import INFERENCE
from speedllm.runtime import Runtime


@torch.inference_mode()
def run(cfg: DictConfig, rt: Runtime) -> None:
    """task=evaluate: see the module docstring."""
    from speedllm.data.loader import build_loader

    ev, t = cfg.evaluate, cfg.train
    if ev.tasks:
        from speedllm.generation import harness

        return harness.run(cfg, rt)
    model = load_model(cfg, rt)
    dp_rank, dp_size, group = 0, 1, None
    if rt.mesh is not None:
        dp_rank, dp_size, group = rt.mesh["dp"].get_local_rank(), rt.mesh["dp"].size(), rt.mesh["dp"].get_group()
    loader = build_loader(cfg, ev.split, dp_rank, dp_size, t.micro_batch_size, t.seq_len, cfg.seed)

    totals = torch.zeros(2, dtype=torch.float64, device=rt.device)  # summed cross-entropy, target tokens
    start = time.perf_counter()
    for _, batch in zip(range(ev.steps), loader):
        batch = {k: v.to(rt.device) for k, v in batch.items()}
        extra = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
        ce_sum, _ = model(batch["tokens"], labels=batch["labels"], **extra)
        totals += torch.stack([ce_sum.double(), (batch["labels"] != IGNORE_INDEX).sum().double()])
    if group is not None:
        dist.all_reduce(totals, group=group)
    ce, num_targets = totals.tolist()  # a host sync: the timing below covers all the work
    seconds = time.perf_counter() - start
    if num_targets == 0:
        raise UserError(f"evaluate.split={ev.split}: no target tokens in {ev.steps} batches; use another split or data")
    loss = ce / num_targets
    result = {
        "split": ev.split, "steps": ev.steps, "loss": loss, "perplexity": math.exp(min(loss, 700.0)),
        "tokens": int(num_targets),
        "tokens_per_s": ev.steps * dp_size * t.micro_batch_size * t.seq_len / seconds,
    }
    if rt.is_main:
        print(f"evaluate {ev.split}: loss {loss:.4f}, perplexity {result['perplexity']:.2f} over "
              f"{result['tokens']} target tokens, {result['tokens_per_s']:.0f} tokens/s")
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / "eval.json").write_text(json.dumps(result, indent=2) + "\n")


def extras(run):
    if run.evaluate.tasks:
        yield "evaluate.tasks", "lm_eval", "eval"


SPEC = replace(INFERENCE, extras=extras)  # a trained model under tensor and data parallelism; lm-eval's suites
