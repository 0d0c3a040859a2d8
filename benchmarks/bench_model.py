"""Forward+backward speed and peak memory: our Qwen3 vs transformers' Qwen3ForCausalLM, same config and batch.

    python benchmarks/bench_model.py [--steps 5] [--loss-chunk-size 1024] [--ops reference] [--configs qwen3_vocab]

Two ~40M-parameter configs, batch 4 x 256, fp32, tied embeddings:
  qwen3_vocab  the real Qwen3 vocabulary (151,936) on qwen3_tiny's layers (4 x 256 hidden): 42.0M parameters,
               38.9M of them the embedding. The issue's setting: speed and peak memory at vocab 151,936.
  vocab_32k    8 layers x 512 hidden at vocab 32,000: 41.6M parameters, most of them in the decoder layers.
Speed: both models in one process with the same weights, timed alternately step by step so load from other
processes hits both alike; the fastest step of each (least disturbed by other processes, as timeit does) ->
tokens/s, and the matmul FLOP rate it implies (train.metrics.flops_per_token) next to this machine's fp32
GEMM rate, measured here on a square 2048 matmul: the ceiling no exact fp32 implementation can pass.
Memory: one forward+backward per model in a fresh subprocess, reporting its peak RSS (VmHWM), which
includes the ~0.3 GB of the Python/torch runtime.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from speedllm.models import Qwen3
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config
from speedllm.train.metrics import flops_per_token, peak_memory_gb

sys.path.insert(0, str(Path(__file__).parent))
from bench_train import DIMS  # noqa: E402  qwen3_tiny's layers

BATCH, SEQ = 4, 256
CONFIGS = {
    "qwen3_vocab": dict(vocab_size=151936, **DIMS),
    "vocab_32k": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64),
}


def model_cfg(name: str):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig),
                           dict(name=name, tie_word_embeddings=True, max_position_embeddings=4096,
                                **CONFIGS[name]))


def build(which: str, config: str, ops: str, loss_chunk_size: int, copy_weights: bool = True):
    """(model, step function running one forward+backward on a fixed batch).

    Our model takes transformers' weights when copy_weights (speed run); the memory run builds it alone so
    that no transformers model ever lives in the process being measured.
    """
    from transformers import Qwen3ForCausalLM

    cfg = model_cfg(config)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(cfg)).train() if which == "transformers" or copy_weights else None
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if which == "transformers":
        def hf_step():
            hf(tokens, labels=tokens).loss.backward()
        return hf, hf_step
    ours = Qwen3(cfg, ops=ops).train()
    if copy_weights:
        ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
        del hf
    else:
        ours.init_weights(seed=0)
    ours.loss_chunk_size = loss_chunk_size
    labels = torch.cat([tokens[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    num_labels = (labels != -100).sum()

    def step():
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
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(config: str, args) -> dict:
    runs = {name: build(name, config, args.ops, args.loss_chunk_size) for name in ("ours", "transformers")}
    times = {name: [] for name in runs}
    for i in range(args.steps + 1):  # the first step warms up and is not timed
        for name, (model, step) in runs.items():
            model.zero_grad(set_to_none=True)
            elapsed = _timed(step)
            if i:
                times[name].append(elapsed)
    row = {"params": sum(p.numel() for p in runs["transformers"][0].parameters()),
           "flops_per_token": flops_per_token(model_cfg(config), SEQ)}
    del runs
    for name in times:
        cmd = [sys.executable, __file__, "--memory-child", name, "--configs", config, "--ops", args.ops,
               "--loss-chunk-size", str(args.loss_chunk_size)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        row[name] = {"tokens_per_s": BATCH * SEQ / min(times[name]),
                     "peak_rss_gb": json.loads(out.strip().splitlines()[-1])["peak_rss_gb"]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ops", default="reference")
    parser.add_argument("--loss-chunk-size", type=int, default=1024)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--memory-child", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
