"""Training throughput and peak memory: our loop vs a plain transformers Qwen3 + torch AdamW loop.

Same architecture (qwen3_tiny's layers at a chosen vocabulary, tied embeddings), batch, sequence length and
AdamW, fp32 on CPU. Ours trains on the demo corpus, transformers on random tokens (the cost does not depend
on token values). Each side runs
in its own subprocess so peak memory (RSS on CPU, allocator peak on a GPU) is its own. The first
--warmup steps are not timed.

    python -m benchmarks train                       # vocab 151,936 (the real Qwen3 vocabulary)
    python -m benchmarks train --vocab 8192 --tokenizer demo --steps 10
    python -m benchmarks train --dry                 # one short step at vocab 8192
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.common import TINY_LAYERS, in_fresh_process, make_parser, parse
from speedllm.config import compose_config
from speedllm.runtime import Runtime
from speedllm.tasks.pretrain import run
from speedllm.train.metrics import peak_memory_gb


def ours(args) -> dict:
    run_dir = tempfile.mkdtemp(prefix="bench_train_")
    overrides = [
        "model=qwen3_tiny", f"model.vocab_size={args.vocab}", "model.tie_word_embeddings=true",
        f"model.tokenizer=${{asset:tokenizers/{args.tokenizer}}}", "hardware=cpu",
        "hardware.dtype=float32",
        f"train.steps={args.warmup + args.steps}",
        f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.batch}", f"train.global_batch_size={args.batch}",
        "train.log_every=1", "train.eval_every=0", "checkpoint.save_final=false",
        "logging.tensorboard=false", "logging.progress_bar=false", "generate.num_samples=0",
        f"run_dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints"]
    cfg = compose_config(*overrides)
    OmegaConf.resolve(cfg)
    run(cfg, Runtime())
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = records[args.warmup:]  # one record per step (log_every=1)
    seconds = sum(args.batch * args.seq_len / r["tokens_per_s"] for r in timed)
    return {"tokens_per_s": len(timed) * args.batch * args.seq_len / seconds, "peak_mem_gb": records[-1]["peak_mem_gb"]}


def transformers_loop(args) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=args.vocab, tie_word_embeddings=True, use_cache=False,
                         max_position_embeddings=4096, rope_theta=10000.0, **TINY_LAYERS)
    model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1))
    elapsed = 0.0
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if step >= args.warmup:
            elapsed += time.perf_counter() - start
    return {"tokens_per_s": args.steps * args.batch * args.seq_len / elapsed,
            "peak_mem_gb": peak_memory_gb(torch.device("cpu"))}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokenizer", default="qwen3", help="ours' bundled tokenizer (no more ids than --vocab)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--side", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    args = parse(parser, argv, vocab=8192, tokenizer="demo", seq_len=32, batch=1, steps=1, warmup=1)
    if args.side:
        print(json.dumps((ours if args.side == "ours" else transformers_loop)(args)))
        return
    results = {}
    for side in ("transformers", "ours"):
        results[side] = in_fresh_process(__name__, *argv, "--side", side)
        print(f"{side:>12}: {results[side]['tokens_per_s']:8.1f} tokens/s   peak {results[side]['peak_mem_gb']:.2f} GB")
    print(f"ratio ours/transformers: tokens/s x{results['ours']['tokens_per_s'] / results['transformers']['tokens_per_s']:.2f}, "
          f"peak memory x{results['ours']['peak_mem_gb'] / results['transformers']['peak_mem_gb']:.2f}  "
          f"(vocab {args.vocab}, batch {args.batch} x {args.seq_len}, fp32 CPU)")
