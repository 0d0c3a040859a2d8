"""Peak memory of a `task=distill` step against the student's SFT step, at the Qwen3 vocabulary (151,936).

    python -m benchmarks distill_memory <scratch dir> [--steps 2] [--dry]

Writes a random teacher (qwen3_tiny's layout, 512 wide, 6 layers, at the Qwen3 vocabulary) with transformers'
save_pretrained under <scratch dir>, then runs the student (qwen3_tiny at the Qwen3 vocabulary) three times through
launch.py on the SFT demo data, each under its own small parent process: `task=sft`, `task=distill
distill.teacher=<dir>`, and the latter with `distill.teacher_quant=int8_wo`. Prints each peak resident set size
(ru_maxrss of the parent's only child), the teacher's weight bytes, and distill / (SFT + teacher weights), which the
design keeps at most 1.3: the divergence is chunked like the loss (speedllm.train.distill_loss), so neither model's
[tokens, vocabulary] logits are ever whole.
--dry: a 8,192-entry vocabulary and one step, in a temporary scratch dir unless one is given.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.bench_quant_memory import CHILD_PEAK
from benchmarks.common import REPO, GiB, make_parser, parse
from speedllm.paths import CONF

QWEN3_VOCAB = 151936
TEACHER = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 8,
           "num_key_value_heads": 4}


def write_teacher(path: Path, vocab: int) -> int:
    """A random teacher saved by transformers (no tokenizer files: only its vocabulary size is checked); returns
    its weight bytes (tied embeddings counted once)."""
    import torch
    from transformers import Qwen3ForCausalLM

    from speedllm.models.config import ModelConfig
    from speedllm.models.hf_adapter import hf_config

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / "qwen3_tiny.yaml"),
                          {**TEACHER, "vocab_size": vocab})
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf_config(cfg))
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("scratch", type=Path, nargs="?", help="where the teacher and the runs go (--dry: optional)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    args = parse(parser, argv, steps=1, vocab=8192)
    if args.scratch is None and not args.dry:
        parser.error("the scratch dir is required (or --dry)")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = args.scratch or Path(tmp)
        teacher = scratch / f"teacher_{args.vocab}"
        teacher_bytes = write_teacher(teacher, args.vocab)
        common = ["model=qwen3_tiny", f"model.vocab_size={args.vocab}", "data=sft_demo", "hardware=cpu",
                  "train.seq_len=256", "train.micro_batch_size=2", "train.global_batch_size=2",
                  f"train.steps={args.steps}", "train.eval_every=0", "checkpoint.save_final=false",
                  "generate.num_samples=0", "logging.progress_bar=false"]
        runs = {"sft": ["task=sft"], "distill": ["task=distill", f"distill.teacher={teacher}"],
                "distill_int8": ["task=distill", f"distill.teacher={teacher}", "distill.teacher_quant=int8_wo"]}
        peaks = {}
        for name, overrides in runs.items():
            argv = [sys.executable, str(REPO / "launch.py"), *common, *overrides,
                    f"hydra.run.dir={scratch / ('run_' + name)}"]
            out = subprocess.run([sys.executable, "-c", CHILD_PEAK, *argv], check=True, capture_output=True, text=True)
            peaks[name] = int(out.stdout.split()[-1]) * 1024 / GiB  # ru_maxrss is in KiB
            print(f"{name:<12} peak RSS {peaks[name]:.3f} GiB", flush=True)
        bound = peaks["sft"] + teacher_bytes / GiB
        print(f"teacher weights {teacher_bytes / GiB:.3f} GiB; distill / (sft + teacher weights) = "
              f"{peaks['distill'] / bound:.3f} (at most 1.3 by design), vocabulary {args.vocab:,}")


if __name__ == "__main__":
    main()
