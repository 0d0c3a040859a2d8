"""QAT int4 against post-training int4 from the same fp32 checkpoint (torchao's protocol), in one command.

    python benchmarks/qat_vs_ptq.py <out dir> --from-step S [--group-size 256] [--steps 20] [--prompts 8] \\
        [-- <training overrides, e.g. train.steps=4000 optim.weight_decay=0>]

1. base: the fp32 run of the overrides' schedule (train.steps), stopped after S steps (`train.stop_after`).
2. from its step-S checkpoint, the rest of the schedule three times with the same data, schedule and seed:
   fp32 (F, `quant=none`) and `quant=qat_int4` (Q, same group size); and fp32 with another seed (F2: what a
   differently trained model of the same quality differs by, the noise of the comparison).
3. the table: valid perplexity of F, int4_wo(F) (post-training), int4_wo(Q), F2 and int4_wo(F2), each against F,
   and the share of 32 greedy tokens on --prompts prompts identical to F's.
A stage whose final checkpoint exists under <out dir> is not run again (stop with SIGTERM, rerun to go on).
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch
from quant_quality import NEW_TOKENS, config, perplexity, prompts_of

from speedllm.generation.engine import generate_ids
from speedllm.generation.load import load_model
from speedllm.generation.sampling import Sampling
from speedllm.paths import ROOT
from speedllm.runtime import Runtime


def train(run_dir: Path, until: int, overrides, start: Path = None, *extra) -> Path:
    """Run launch.py into run_dir until step `until`, from its own latest checkpoint if it has one (an interrupted
    run), else from `start` (None: from scratch); returns its checkpoint at that step."""
    from speedllm.checkpoint.dcp import latest_checkpoint

    done = run_dir / "checkpoints" / f"step_{until:08d}"
    if not done.is_dir():
        load = latest_checkpoint(str(run_dir / "checkpoints")) or start
        at = 0 if load is None else int(load.name.removeprefix("step_"))
        print(f"training {run_dir.name} from step {at} to step {until}", flush=True)
        subprocess.run([sys.executable, str(ROOT / "launch.py"), f"run_dir={run_dir}", "logging.tensorboard=false",
                        *overrides, *extra, f"train.stop_after={until - at}",
                        *([f"checkpoint.load={load}"] if load else [])], check=True, stdout=subprocess.DEVNULL)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--from-step", type=int, required=True, help="step of the fp32 checkpoint QAT starts from")
    parser.add_argument("--group-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="valid micro-batches for perplexity")
    parser.add_argument("--prompts", type=int, default=8)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.overrides = argv[split + 1:]  # training overrides shared by every run
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the training runs: one thread, the box is shared
    from speedllm.config import compose_config

    total = compose_config(*args.overrides).train.steps
    start = train(args.out / "base", args.from_step, args.overrides)
    runs = {"F": train(args.out / "fp32", total, args.overrides, start),
            "Q": train(args.out / "qat_int4", total, args.overrides, start, "quant=qat_int4",
                       f"quant.group_size={args.group_size}"),
            "F2": train(args.out / "fp32_seed2", total, args.overrides, start, "seed=2")}
    rows = [("F", "none", "fp32 continuation F"), ("F", "int4_wo", "int4_wo(F), post-training"),
            ("Q", "qat_int4", "int4_wo(Q), QAT"), ("Q", "none", "Q in fp32 (fake quant off)"),
            ("F2", "none", "fp32, seed 2 (noise)"), ("F2", "int4_wo", "int4_wo(F2), post-training")]
    torch.set_num_threads(1)
    print("\n| model | valid perplexity | vs F | greedy tokens identical to F |\n|---|---|---|---|")
    reference = base_ppl = prompts = None
    for run, quant, label in rows:
        cfg = config(str(runs[run]), quant, args.group_size)
        model = load_model(cfg, Runtime())
        prompts = prompts or prompts_of(cfg, args.prompts)
        ppl = perplexity(model, cfg, args.steps)
        tokens = generate_ids(model, prompts, NEW_TOKENS, Sampling(), [], 0, torch.float32)
        reference, base_ppl = reference or tokens, base_ppl or ppl
        same = sum(a == b for r, t in zip(reference, tokens) for a, b in zip(r, t)) / (NEW_TOKENS * len(prompts))
        print(f"| {label} | {ppl:.3f} | {(ppl / base_ppl - 1) * 100:+.2f}% | {same * 100:.1f}% |", flush=True)


if __name__ == "__main__":
    main()
