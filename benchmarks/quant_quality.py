"""Quality of quantized inference on trained checkpoints: perplexity on the valid split and greedy agreement.

    python -m benchmarks quant_quality <checkpoint dir> [<qat checkpoint dir>] [--steps 20] [--prompts 8] \\
        [--group-size 128] [--dry]

For the first checkpoint (trained in full precision): perplexity of fp32, int8_wo and int4_wo (post-training
quantization) over --steps micro-batches of the valid split, exactly as task=evaluate reads them, and the share
of 32 greedy tokens on --prompts prompts (16-token openings of valid sequences) that int8_wo / int4_wo produce
identically to fp32. With a second checkpoint trained under quant=qat_int4, its int4_wo perplexity too.
--dry: a checkpoint of a few qwen3_tiny steps, trained first into a temporary directory.
"""

import tempfile
from pathlib import Path

from benchmarks.common import DRY_TRAINING, make_parser, parse, quality, train


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("checkpoint", nargs="?", help="(--dry: trained here)")
    parser.add_argument("qat_checkpoint", nargs="?")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size (the QAT run's)")
    args = parse(parser, argv, steps=2, prompts=2)
    if args.checkpoint is None and not args.dry:
        parser.error("the checkpoint dir is required (or --dry)")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or train(Path(tmp), 4, DRY_TRAINING)
        runs = [(checkpoint, q) for q in ("none", "int8_wo", "int4_wo")]
        if args.qat_checkpoint:
            runs.append((args.qat_checkpoint, "qat_int4"))
        for (checkpoint, quant), (ppl, change, same) in zip(runs, quality(runs, args.group_size, args.steps,
                                                                            args.prompts)):
            print(f"{quant:<9} {checkpoint}: valid perplexity {ppl:.3f} ({change * 100:+.2f}% vs fp32), "
                  f"greedy tokens identical to fp32: {same * 100:.1f}%", flush=True)
