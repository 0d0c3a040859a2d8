"""Forward+backward speed and peak memory: our Qwen3 vs transformers' Qwen3ForCausalLM, same config and batch.

    python benchmarks/bench_model.py [--steps 5] [--loss-chunk-size 1024] [--ops reference]

Speed: ~40M parameters (vocab 32,000), batch 4 x 256, fp32, both models in one process with the same weights,
timed alternately step by step so load from other processes hits both alike; the fastest step of each
(least disturbed by other processes, as timeit does) -> tokens/s.
Memory: the same model at vocab 151,936, one forward+backward per variant, each in a fresh subprocess,
reporting its peak RSS (ru_maxrss), which includes the ~0.3 GB of the Python/torch runtime.
"""

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from omegaconf import OmegaConf

from speedllm.config.schema import ModelConfig
from speedllm.models import Qwen3
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config

BATCH, SEQ = 4, 256


def model_cfg(vocab_size: int):
    return OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        dict(name="bench_40m", vocab_size=vocab_size, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
             max_position_embeddings=4096),
    )


def build(which: str, vocab_size: int, ops: str, loss_chunk_size: int, copy_weights: bool = True):
    """(model, step function running one forward+backward on a fixed batch).

    Our model takes transformers' weights when copy_weights (speed run); the memory run builds it alone so
    that no transformers model ever lives in the process being measured.
    """
    from transformers import Qwen3ForCausalLM

    cfg = model_cfg(vocab_size)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(cfg)).train() if which == "transformers" or copy_weights else None
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
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


def peak_memory(which: str, ops: str, loss_chunk_size: int) -> None:
    """Child process: one step at vocab 151,936, print peak RSS in GB as JSON."""
    model, step = build(which, 151936, ops, loss_chunk_size, copy_weights=False)
    step()
    print(json.dumps({"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ops", default="reference")
    parser.add_argument("--loss-chunk-size", type=int, default=1024)
    parser.add_argument("--memory-child", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        peak_memory(args.memory_child, args.ops, args.loss_chunk_size)
        return

    runs = {name: build(name, 32000, args.ops, args.loss_chunk_size) for name in ("ours", "transformers")}
    n_params = sum(p.numel() for p in runs["transformers"][0].parameters())
    times = {name: [] for name in runs}
    for i in range(args.steps + 1):  # the first step warms up and is not timed
        for name, (model, step) in runs.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            if i:
                times[name].append(time.perf_counter() - start)
    tps = {name: BATCH * SEQ / min(t) for name, t in times.items()}

    memory = {}
    for name in runs:
        cmd = [sys.executable, __file__, "--memory-child", name, "--ops", args.ops,
               "--loss-chunk-size", str(args.loss_chunk_size)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        memory[name] = json.loads(out.strip().splitlines()[-1])["peak_rss_gb"]

    print(f"Qwen3 {n_params / 1e6:.1f}M params, batch {BATCH}x{SEQ}, fp32, {torch.get_num_threads()} threads, "
          f"ops={args.ops}, loss_chunk_size={args.loss_chunk_size}, {args.steps} timed steps (fastest)")
    print(f"{'':14}{'fwd+bwd tokens/s':>18}{'peak RSS @151936 (GB)':>24}")
    for name in runs:
        print(f"{name:14}{tps[name]:>18.1f}{memory[name]:>24.2f}")
    print(f"ratio ours/transformers: tokens/s x{tps['ours'] / tps['transformers']:.2f} (target >= 1.2), "
          f"peak memory x{memory['ours'] / memory['transformers']:.2f} (target <= 0.8)")


if __name__ == "__main__":
    main()
