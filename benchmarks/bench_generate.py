"""Generation speed: our engine (static KV cache) vs transformers' `generate`, same ~40M-parameter Qwen3, one run.

    python benchmarks/bench_generate.py [--new-tokens 64] [--repeats 3] [--threads 1] [--clock cpu|wall]

Both run greedy, fp32, on the same weights, alternately (so load from other processes hits both alike); each
number is the median over --repeats. Decode tokens/s = (N - 1) new tokens per row / (time of a generation
of N tokens - time of a generation of 1 token), i.e. the prefill is subtracted out. Prefill tokens/s = prompt
tokens / time of a generation of one token. Both generate the same token ids (checked and printed).

--clock cpu (default) times with this process's CPU time on one thread: on a machine shared with other jobs,
wall time mostly measures how often the scheduler runs us, CPU time measures the work each side does.
--clock wall with --threads 0 (torch's default) is the number a user sees on an idle machine.
"""

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from speedllm.generation.engine import generate_ids
from speedllm.generation.sampling import Sampling
from speedllm.models import Qwen3, num_params
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config

PROMPT_LEN, PREFILL_LEN = 16, 512


def model_cfg():
    return OmegaConf.merge(
        OmegaConf.structured(ModelConfig),
        dict(name="bench_40m", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True,
             max_position_embeddings=4096),
    )


def timed(fn, repeats: int, clock) -> tuple:
    """(median seconds, last result)."""
    times, result = [], None
    for _ in range(repeats):
        start = clock()
        result = fn()
        times.append(clock() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = parser.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3ForCausalLM

    cfg = model_cfg()
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(cfg)).eval()
    ours = Qwen3(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    print(f"model: {num_params(ours) / 1e6:.1f}M parameters, fp32, {torch.get_num_threads()} threads, "
          f"{args.clock} clock")

    def run_hf(prompt_BS, new_tokens):
        with torch.inference_mode():
            out = hf.generate(prompt_BS, attention_mask=torch.ones_like(prompt_BS), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[:, prompt_BS.shape[1]:].tolist()

    def run_ours(prompt_BS, new_tokens):
        return generate_ids(ours, prompt_BS.tolist(), new_tokens, Sampling(), [], 0, torch.float32)

    runners = {"transformers": run_hf, "speedllm": run_ours}
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in (1, 8):
        prompt = torch.randint(0, cfg.vocab_size, (batch, PROMPT_LEN), generator=gen)
        decode, ids = {}, {}
        for name, fn in runners.items():
            fn(prompt, 2)  # warm-up
            full, ids[name] = timed(lambda: fn(prompt, args.new_tokens), args.repeats, clock)
            first, _ = timed(lambda: fn(prompt, 1), args.repeats, clock)
            decode[name] = batch * (args.new_tokens - 1) / (full - first)
        same = ids["transformers"] == ids["speedllm"]
        rows.append((f"decode tokens/s, batch {batch}", decode, same))
    prompt = torch.randint(0, cfg.vocab_size, (1, PREFILL_LEN), generator=gen)
    prefill = {}
    for name, fn in runners.items():
        seconds, _ = timed(lambda: fn(prompt, 1), args.repeats, clock)
        prefill[name] = PREFILL_LEN / seconds
    rows.append((f"prefill tokens/s, 1 x {PREFILL_LEN}", prefill, None))

    print("| metric | transformers | speedllm | ratio | same ids |\n|---|---|---|---|---|")
    for metric, values, same in rows:
        ratio = values["speedllm"] / values["transformers"]
        print(f"| {metric} | {values['transformers']:.1f} | {values['speedllm']:.1f} | {ratio:.2f}x | "
              f"{'-' if same is None else same} |")


if __name__ == "__main__":
    main()
