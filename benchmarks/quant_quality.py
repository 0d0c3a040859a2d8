"""Quality of quantized inference on trained checkpoints: perplexity on the valid split and greedy agreement.

    python benchmarks/quant_quality.py <checkpoint dir> [<qat checkpoint dir>] [--steps 20] [--prompts 8] [--group-size 128]

For the first checkpoint (trained in full precision): perplexity of fp32, int8_wo and int4_wo (post-training
quantization) over --steps micro-batches of the valid split, exactly as task=evaluate reads them, and the share
of 32 greedy tokens on --prompts prompts (16-token openings of valid sequences) that int8_wo / int4_wo produce
identically to fp32. With a second checkpoint trained under quant=qat_int4, its int4_wo perplexity too.
"""

import argparse
import math

import torch

from speedllm.config import compose_config
from speedllm.config.resolve import adopt_checkpoint_config
from speedllm.generation.engine import generate_ids
from speedllm.generation.load import load_model
from speedllm.generation.sampling import Sampling
from speedllm.runtime import Runtime

NEW_TOKENS, PROMPT_LEN = 32, 16


def config(checkpoint: str, quant: str, group_size: int):
    cfg = compose_config("task=evaluate", f"checkpoint.load={checkpoint}", f"quant={quant}",
                         f"quant.group_size={group_size}", "run_dir=/tmp", "hardware=cpu")
    adopt_checkpoint_config(cfg)  # the checkpoint's step directory, model and tokenizer
    return cfg


@torch.inference_mode()
def perplexity(model, cfg, steps: int) -> float:
    from speedllm.data.loader import build_loader

    loader = build_loader(cfg, "valid", 0, 1, cfg.train.micro_batch_size, cfg.train.seq_len, cfg.seed)
    ce = count = 0.0
    for _, batch in zip(range(steps), loader):
        loss, _ = model(batch["tokens"], labels=batch["labels"])
        ce, count = ce + float(loss), count + int((batch["labels"] != -100).sum())
    return math.exp(ce / count)


def prompts_of(cfg, num: int):
    from speedllm.data.loader import build_loader

    batch = next(iter(build_loader(cfg, "valid", 0, 1, num, cfg.train.seq_len, cfg.seed)))
    return batch["tokens"][:, :PROMPT_LEN].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("qat_checkpoint", nargs="?")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=128, help="int4 group size (the QAT run's)")
    args = parser.parse_args()
    runs = [(args.checkpoint, q) for q in ("none", "int8_wo", "int4_wo")]
    if args.qat_checkpoint:
        runs.append((args.qat_checkpoint, "qat_int4"))
    reference = base_ppl = None
    for checkpoint, quant in runs:
        cfg = config(checkpoint, quant, args.group_size)
        model = load_model(cfg, Runtime())
        if reference is None:
            prompts = prompts_of(cfg, args.prompts)
        ppl = perplexity(model, cfg, args.steps)
        tokens = generate_ids(model, prompts, NEW_TOKENS, Sampling(), [], 0, torch.float32)
        if reference is None:
            reference, base_ppl = tokens, ppl
        same = sum(a == b for r, t in zip(reference, tokens) for a, b in zip(r, t)) / (NEW_TOKENS * len(prompts))
        print(f"{quant:<9} {checkpoint}: valid perplexity {ppl:.3f} ({(ppl / base_ppl - 1) * 100:+.2f}% vs fp32), "
              f"greedy tokens identical to fp32: {same * 100:.1f}%", flush=True)


if __name__ == "__main__":
    main()
