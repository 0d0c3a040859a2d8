"""Peak memory of `task=generate` on the qwen3_0.6b size: fp32 vs int8_wo vs int4_wo, each in its own process.

    python benchmarks/bench_quant_memory.py <scratch dir> [--quants none int8_wo int4_wo] [--new-tokens 8]

Writes random qwen3_0.6b-sized weights once as a Hugging Face directory (transformers' save_pretrained, with the
bundled Qwen3 tokenizer) under <scratch dir>, then runs `python launch.py task=generate model=hf
checkpoint.load_hf=<dir> quant=<q>` once per quant, each under its own small parent process, and prints the
peak resident set size of the generate process (ru_maxrss of the parent's only child: anonymous memory and
the pages of the safetensors file mapped while reading, all counted).
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from speedllm.paths import ASSETS, CONF, ROOT

CHILD_PEAK = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
              "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def write_model(path: Path) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    from speedllm.models.config import ModelConfig
    from speedllm.models.hf_adapter import hf_config

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / "qwen3_0.6b.yaml"))
    torch.manual_seed(0)
    Qwen3ForCausalLM(hf_config(cfg)).save_pretrained(path)
    for file in (ASSETS / "tokenizers" / "qwen3").iterdir():
        shutil.copy(file, path / file.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scratch", type=Path)
    parser.add_argument("--quants", nargs="+", default=["none", "int8_wo", "int4_wo"])
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    model = args.scratch / "qwen3_0.6b_random"
    if not (model / "config.json").exists():
        write_model(model)
    peaks = {}
    for quant in args.quants:
        argv = [sys.executable, str(ROOT / "launch.py"), "task=generate", "model=hf", f"checkpoint.load_hf={model}",
                f"quant={quant}", "hardware=cpu", "generate.prompt=Hello", f"generate.max_new_tokens={args.new_tokens}",
                f"hydra.run.dir={args.scratch / ('run_' + quant)}"]
        out = subprocess.run([sys.executable, "-c", CHILD_PEAK, *argv], check=True, capture_output=True, text=True)
        peaks[quant] = int(out.stdout.split()[-1]) / 2**20  # ru_maxrss is in KiB
        print(f"quant={quant:<8} peak RSS {peaks[quant]:.2f} GiB   x{peaks[quant] / peaks[args.quants[0]]:.2f} "
              f"of quant={args.quants[0]}", flush=True)


if __name__ == "__main__":
    main()
