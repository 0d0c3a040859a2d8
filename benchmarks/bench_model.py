"""Forward+backward speed and peak memory: our Qwen3 vs transformers' Qwen3ForCausalLM, same config and batch.

    python -m benchmarks model [--steps 5] [--loss-chunk-size 1024] [--ops reference] [--configs qwen3_vocab] [--dry]

Two ~40M-parameter configs, batch 4 x 256, fp32, tied embeddings:
  qwen3_vocab  the real Qwen3 vocabulary (151,936) on qwen3_tiny's layers (4 x 256 hidden): 42.0M parameters,
               38.9M of them the embedding. The issue's setting: speed and peak memory at vocab 151,936.
  vocab_32k    8 layers x 512 hidden at vocab 32,000: 41.6M parameters, most of them in the decoder layers.
Speed: both models in one process with the same weights, timed alternately step by step so load from other
processes hits both alike; the fastest step of each (least disturbed by other processes, as timeit does) ->
tokens/s, and the matmul FLOP rate it implies (train.metrics.flops_per_token) next to this machine's fp32
GEMM rate, measured here on a square 2048 matmul: the ceiling no exact fp32 implementation can pass.
Memory: one forward+backward per model in a fresh subprocess, reporting its peak RSS (VmHWM), which
includes the ~0.3 GB of the Python/torch runtime. --dry: one step of the `tiny` config.
"""

import argparse
import json

import torch

from benchmarks.common import BATCH, SEQ, batch, in_fresh_process, interleaved, make_parser, model_cfg, parse, timed
from speedllm.models import Qwen3
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config
from speedllm.train.metrics import flops_per_token, peak_memory_gb

DEFAULT_CONFIGS = ["qwen3_vocab", "vocab_32k"]


def build(which: str, config: str, ops: str, loss_chunk_size: int, copy_weights: bool = True):
    """(model, step function running one forward+backward on a fixed batch).

    Our model takes transformers' weights when copy_weights (speed run); the memory run builds it alone so
    that no transformers model ever lives in the process being measured.
    """
    from transformers import Qwen3ForCausalLM

    cfg = model_cfg(config)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(cfg)).train() if which == "transformers" or copy_weights else None
    tokens, labels = batch(cfg.vocab_size)
    if which == "transformers":
        def hf_step():
            hf.zero_grad(set_to_none=True)
            hf(tokens, labels=tokens).loss.backward()
        return hf, hf_step
    ours = Qwen3(cfg, ops=ops).train()
    if copy_weights:
        ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
        del hf
    else:
        ours.init_weights(seed=0)
    ours.loss_chunk_size = loss_chunk_size
    num_labels = (labels != -100).sum()

    def step():
        ours.zero_grad(set_to_none=True)
        ce_sum, aux = ours(tokens, labels=labels)
        (ce_sum / num_labels + aux).backward()
    return ours, step


def peak_memory(which: str, config: str, ops: str, loss_chunk_size: int) -> None:
    """Child process: one step, print peak RSS in GB as JSON."""
    model, step = build(which, config, ops, loss_chunk_size, copy_weights=False)
    step()
    print(json.dumps({"peak_rss_gb": peak_memory_gb(torch.device("cpu"))}))


def gemm_gflops(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(timed(lambda: a @ b)[0] for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def bench(config: str, args) -> dict:
    runs = {name: build(name, config, args.ops, args.loss_chunk_size) for name in ("ours", "transformers")}
    # the first step warms up and is not timed
    times, _ = interleaved({name: step for name, (_, step) in runs.items()}, args.steps, warmup=1)
    row = {"params": sum(p.numel() for p in runs["transformers"][0].parameters()),
           "flops_per_token": flops_per_token(model_cfg(config), SEQ)}
    del runs
    for name in times:
        child = in_fresh_process(__name__, "--memory-child", name, "--configs", config, "--ops", args.ops,
                          "--loss-chunk-size", args.loss_chunk_size)
        row[name] = {"tokens_per_s": BATCH * SEQ / min(times[name]), "peak_rss_gb": child["peak_rss_gb"]}
    return row


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ops", default="reference")
    parser.add_argument("--loss-chunk-size", type=int, default=1024)
    parser.add_argument("--configs", nargs="+", choices=[*DEFAULT_CONFIGS, "tiny"], default=DEFAULT_CONFIGS)
    parser.add_argument("--memory-child", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    args = parse(parser, argv, steps=1, configs=["tiny"])
    if args.memory_child:
        peak_memory(args.memory_child, args.configs[0], args.ops, args.loss_chunk_size)
        return

    rows = {config: bench(config, args) for config in args.configs}
    gemm = gemm_gflops()
    print(f"Qwen3 fwd+bwd, batch {BATCH}x{SEQ}, fp32, {torch.get_num_threads()} threads, ops={args.ops}, "
          f"loss_chunk_size={args.loss_chunk_size}, fastest of {args.steps} steps; fp32 GEMM here: {gemm:.0f} GFLOP/s")
    print(f"{'config':13}{'params':>8}{'model':>14}{'tokens/s':>10}{'GFLOP/s':>9}{'peak RSS GB':>13}")
    for config, row in rows.items():
        for name in ("ours", "transformers"):
            r = row[name]
            print(f"{config:13}{row['params'] / 1e6:>7.1f}M{name:>14}{r['tokens_per_s']:>10.1f}"
                  f"{r['tokens_per_s'] * row['flops_per_token'] / 1e9:>9.1f}{r['peak_rss_gb']:>13.2f}")
        ours, hf = row["ours"], row["transformers"]
        print(f"{config:13} ours/transformers: tokens/s x{ours['tokens_per_s'] / hf['tokens_per_s']:.2f} "
              f"(target >= 1.2), peak memory x{ours['peak_rss_gb'] / hf['peak_rss_gb']:.2f} (target <= 0.8)")
