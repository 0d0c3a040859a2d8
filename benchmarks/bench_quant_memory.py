"""Peak memory of `task=generate` on the qwen3_0.6b size: fp32 vs int8_wo vs int4_wo, each in its own process.

    python -m benchmarks quant_memory <scratch dir> [--quants none int8_wo int4_wo] [--new-tokens 8] [--dry]

Writes random qwen3_0.6b-sized weights once as a Hugging Face directory (transformers' save_pretrained, with the
bundled Qwen3 tokenizer) under <scratch dir>, then runs `python launch.py task=generate model=hf
checkpoint.load_hf=<dir> quant=<q>` once per quant, each under its own small parent process, and prints the
peak resident set size of the generate process (ru_maxrss of the parent's only child: anonymous memory and
the pages of the safetensors file mapped while reading, all counted). --dry: the `tiny` layers at the Qwen3
vocabulary, fp32 and int8_wo, in a temporary scratch dir unless one is given.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from benchmarks.common import CONFIGS, REPO, make_parser, parse
from speedllm.paths import ASSETS, CONF

CHILD_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def write_model(path: Path, dry: bool) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    from speedllm.models.config import ModelConfig
    from speedllm.models.hf_adapter import hf_config

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / "qwen3_0.6b.yaml"))
    if dry:  # the tokenizer's vocabulary stays
        cfg = OmegaConf.merge(cfg, {k: v for k, v in CONFIGS["tiny"].items() if k != "vocab_size"})
    torch.manual_seed(0)
    Qwen3ForCausalLM(hf_config(cfg)).save_pretrained(path)
    for file in (ASSETS / "tokenizers" / "qwen3").iterdir():
        shutil.copy(file, path / file.name)


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("scratch", type=Path, nargs="?", help="where the model and the runs go (--dry: optional)")
    parser.add_argument("--quants", nargs="+", default=["none", "int8_wo", "int4_wo"])
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parse(parser, argv, quants=["none", "int8_wo"], new_tokens=2)
    if args.scratch is None and not args.dry:
        parser.error("the scratch dir is required (or --dry)")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = args.scratch or Path(tmp)
        model = scratch / ("tiny_random" if args.dry else "qwen3_0.6b_random")
        if not (model / "config.json").exists():
            write_model(model, args.dry)
        peaks = {}
        for quant in args.quants:
            argv = [sys.executable, str(REPO / "launch.py"), "task=generate", "model=hf", f"checkpoint.load_hf={model}",
                    f"quant={quant}", "hardware=cpu", "generate.prompt=Hello",
                    f"generate.max_new_tokens={args.new_tokens}", f"hydra.run.dir={scratch / ('run_' + quant)}"]
            out = subprocess.run([sys.executable, "-c", CHILD_PEAK, *argv], check=True, capture_output=True, text=True)
            peaks[quant] = int(out.stdout.split()[-1]) / 2**20  # ru_maxrss is in KiB
            print(f"quant={quant:<8} peak RSS {peaks[quant]:.2f} GiB   x{peaks[quant] / peaks[args.quants[0]]:.2f} "
                  f"of quant={args.quants[0]}", flush=True)
