"""QAT int4 against post-training int4 from the same fp32 checkpoint (torchao's protocol), in one command.

    python -m benchmarks qat_vs_ptq <out dir> --from-step S [--group-size 256] [--steps 20] [--prompts 8] [--dry] \\
        [-- <training overrides, e.g. train.steps=4000 optim.weight_decay=0>]

1. base: the fp32 run of the overrides' schedule (train.steps), stopped after S steps (`train.stop_after`).
2. from its step-S checkpoint, the rest of the schedule three times with the same data, schedule and seed:
   fp32 (F, `quant=none`) and `quant=qat_int4` (Q, same group size); and fp32 with another seed (F2: what a
   differently trained model of the same quality differs by, the noise of the comparison).
3. the table: valid perplexity of F, int4_wo(F) (post-training), int4_wo(Q), F2 and int4_wo(F2), each against F,
   and the share of 32 greedy tokens on --prompts prompts identical to F's.
A stage whose final checkpoint exists under <out dir> is not run again (stop with SIGTERM, rerun to go on).
--dry: a few qwen3_tiny steps (common.DRY_TRAINING) in a temporary <out dir> unless one is given.
"""

import os
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import DRY_TRAINING, make_parser, parse, quality, train
from speedllm.config import compose_config


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("out", type=Path, nargs="?", help="(--dry: optional)")
    parser.add_argument("--from-step", type=int, help="step of the fp32 checkpoint QAT starts from (required)")
    parser.add_argument("--group-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="valid micro-batches for perplexity")
    parser.add_argument("--prompts", type=int, default=8)
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parse(parser, argv[:split], from_step=2, group_size=128, steps=2, prompts=2)
    if args.from_step is None or (args.out is None and not args.dry):
        parser.error("<out dir> and --from-step are required (or --dry)")
    overrides = (list(DRY_TRAINING) if args.dry else []) + argv[split + 1:]  # training overrides shared by every run
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the training runs: one thread, the box is shared
    with tempfile.TemporaryDirectory() as tmp:
        compare(args.out or Path(tmp), args, overrides)


def compare(out: Path, args, overrides) -> None:
    total = compose_config(*overrides).train.steps
    start = train(out / "base", args.from_step, overrides)
    runs = {"F": train(out / "fp32", total, overrides, start),
            "Q": train(out / "qat_int4", total, overrides, start, "quant=qat_int4",
                       f"quant.group_size={args.group_size}"),
            "F2": train(out / "fp32_seed2", total, overrides, start, "seed=2")}
    rows = [("F", "none", "fp32 continuation F"), ("F", "int4_wo", "int4_wo(F), post-training"),
            ("Q", "qat_int4", "int4_wo(Q), QAT"), ("Q", "none", "Q in fp32 (fake quant off)"),
            ("F2", "none", "fp32, seed 2 (noise)"), ("F2", "int4_wo", "int4_wo(F2), post-training")]
    torch.set_num_threads(1)
    print("\n| model | valid perplexity | vs F | greedy tokens identical to F |\n|---|---|---|---|")
    measured = quality([(str(runs[run]), quant) for run, quant, _ in rows], args.group_size, args.steps, args.prompts)
    for (_, _, label), (ppl, change, same) in zip(rows, measured):
        print(f"| {label} | {ppl:.3f} | {change * 100:+.2f}% | {same * 100:.1f}% |", flush=True)
