"""Per-rank peak memory under FSDP2 over N ranks against (parameters + gradients + optimizer states)/N + activations.

    python -m benchmarks fsdp_memory [--ranks 1 2 4] [--layers 8] [--hidden 512] [--dry]

Each N runs in its own gloo process group on this machine (CPU). Rank 0 builds the model through the training
code path (speedllm.train.build.build_model: meta build, parallelize, materialize), runs two AdamW steps of one
micro-batch, and measures tensor memory with torch's own trackers (MemTracker for one process,
FSDPMemTracker under FSDP) over the second step, so the optimizer states exist. The estimate uses the
activations measured in the single-process run: fp32 parameters (4 B), gradients (4 B) and AdamW's two
moments (8 B) per parameter, divided by N.
"""

import os

import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from benchmarks.common import MiB, free_port, make_parser, parse
from speedllm.config import compose_config
from speedllm.models.qwen3 import Qwen3, num_params
from speedllm.runtime import Runtime, init_runtime
from speedllm.train.build import build_model
from speedllm.train.optimizer import build_optimizer


def config(args, ranks: int):
    cfg = compose_config(
        "model=qwen3_tiny", f"model.hidden_size={args.hidden}", f"model.intermediate_size={3 * args.hidden}",
        f"model.num_hidden_layers={args.layers}", "model.num_attention_heads=8", "model.num_key_value_heads=4",
        "model.head_dim=64", "hardware=cpu", f"parallel.dp={ranks}", f"train.seq_len={args.seq_len}",
        f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch * ranks}",
        "run_dir=/tmp/bench_fsdp_memory")
    OmegaConf.resolve(cfg)
    return cfg


def worker(rank: int, ranks: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(ranks),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, 2 // ranks))
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = config(args, ranks)
    rt = init_runtime(cfg) if ranks > 1 else Runtime()
    model = build_model(cfg, rt).module
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(rank))

    def step():
        ce_sum, _ = model(tokens[:, :-1], labels=tokens[:, 1:])
        (ce_sum / tokens[:, 1:].numel()).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # creates the optimizer states
    tracker = FSDPMemTracker(model, optimizer) if ranks > 1 else MemTracker()
    if ranks == 1:
        tracker.track_external(model, optimizer)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")
    per_device = next(iter(peak.values()))
    if rank == 0:
        with torch.device("meta"):
            params = num_params(Qwen3(cfg.model))
        results[ranks] = {"params": params, "total": per_device["Total"],
                          "parts": {str(k): v for k, v in per_device.items() if k != "Total" and v > 0}}
    if ranks > 1:
        torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parse(parser, argv, ranks=[1, 2], layers=1, hidden=64, seq_len=32, batch=1)
    results = mp.Manager().dict()
    for ranks in args.ranks:
        mp.spawn(worker, args=(ranks, free_port(), args, results), nprocs=ranks)
    one = results[min(args.ranks)]
    states = 16 * one["params"]  # fp32 parameters + gradients + AdamW exp_avg + exp_avg_sq
    activations = one["parts"].get("_MemRefType.ACT", one["parts"].get("act", 0))
    print(f"model: {one['params'] / 1e6:.1f}M parameters, states {states / MiB:.0f} MiB; "
          f"activations (measured, 1 rank): {activations / MiB:.0f} MiB")
    print("| ranks | measured peak MiB | (states)/N + activations MiB | breakdown at peak (MiB) |")
    print("|---|---|---|---|")
    for ranks in args.ranks:
        r = results[ranks]
        parts = ", ".join(f"{k.split('.')[-1].lower()} {v / MiB:.0f}" for k, v in sorted(r["parts"].items()))
        print(f"| {ranks} | {r['total'] / MiB:.0f} | {(states / ranks + activations) / MiB:.0f} | {parts} |")
