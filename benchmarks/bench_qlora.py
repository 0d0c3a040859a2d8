"""Peak memory and loss of a QLoRA step against a LoRA step on the fp32 base, qwen3_0.6b-sized, on the CPU.

    python -m benchmarks qlora [--model qwen3_0.6b] [--steps 3] [--seq-len 128] [--loss-chunk-size 128] [--dry]

Each mode runs in its own process through the training code path (build_model, speedllm.checkpoint.adapters.load_base:
a random fp32 base, which finetune=qlora turns into NF4, then train_step on the bundled SFT set with the Qwen3
tokenizer). The step peak is the process's peak resident memory over the training steps, measured from a reset
of the kernel's high-water mark (/proc/self/clear_refs) after the model is ready, so the fp32 start both modes
share is not counted; large allocations are mmapped (MALLOC_MMAP_THRESHOLD_) so freed fp32 weights leave the
resident set. Losses: the same batches, the same seed. --dry: one short step of qwen3_tiny.
"""

import gc
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.common import GiB, in_fresh_process, make_parser, parse, proc_status_kib
from speedllm.checkpoint.adapters import load_base
from speedllm.config import compose_config
from speedllm.data.loader import build_loader
from speedllm.runtime import Runtime, seed_everything
from speedllm.train.build import build_model
from speedllm.train.optimizer import build_optimizer
from speedllm.train.schedule import build_scheduler
from speedllm.train.step import train_step


def rss_gib(field: str) -> float:
    return proc_status_kib(field) * 1024 / GiB


def worker(args) -> dict:
    cfg = compose_config(
            f"model={args.model}", "hardware=cpu", "task=sft", f"finetune={args.worker}", f"train.seq_len={args.seq_len}",
            "train.micro_batch_size=1", "train.global_batch_size=1", "optim.warmup_steps=0", "optim.lr=1e-3",
            f"train.loss_chunk_size={args.loss_chunk_size}", "run_dir=/tmp/bench_qlora")
    OmegaConf.resolve(cfg)
    seed_everything(cfg.seed)
    pm = build_model(cfg, Runtime())
    load_base(pm.parts, cfg, None)
    optimizer = build_optimizer(pm.module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, args.steps)
    loader = build_loader(cfg, "train", 0, 1, 1, cfg.train.seq_len, cfg.seed)
    batches = [next(loader) for _ in range(args.steps)]
    gc.collect()
    ready = rss_gib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    losses = [train_step(pm, optimizer, scheduler, [b], cfg, 1, None, torch.autocast("cpu", enabled=False))[0]
              for b in batches]
    return {"mode": args.worker, "ready_gib": ready, "step_peak_gib": rss_gib("VmHWM"), "losses": losses}


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--model", default="qwen3_0.6b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    # tokens per chunk of the output projection + loss: on CPU its fp32 logits buffer (chunk x 151,936 x 4 bytes)
    # is kept between steps, the same in both modes
    parser.add_argument("--loss-chunk-size", type=int, default=128)
    parser.add_argument("--worker", choices=["lora", "qlora"])
    args = parse(parser, argv, model="qwen3_tiny", steps=1)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    results = {}
    for mode in ("lora", "qlora"):
        r = results[mode] = in_fresh_process(
            __name__, "--worker", mode, "--model", args.model, "--steps", args.steps, "--seq-len", args.seq_len,
            "--loss-chunk-size", args.loss_chunk_size, env={"MALLOC_MMAP_THRESHOLD_": str(2**16)})
        print(f"{args.model}, {args.steps} steps of 1 x {args.seq_len} tokens, fp32 compute, rank 8, {mode}: model "
              f"ready {r['ready_gib']:.2f} GiB, step peak {r['step_peak_gib']:.2f} GiB, losses "
              f"{', '.join(f'{x:.4f}' for x in r['losses'])}", flush=True)
    lora, qlora = results["lora"], results["qlora"]
    print(f"  step peak qlora / lora: {qlora['step_peak_gib'] / lora['step_peak_gib']:.3f}; last loss qlora / lora: "
          f"{qlora['losses'][-1] / lora['losses'][-1]:.4f}")
