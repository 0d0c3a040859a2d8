"""Generation speed: our engine (static KV cache) vs transformers' `generate`, same ~40M-parameter Qwen3, one run.

    python -m benchmarks generate [--new-tokens 64] [--repeats 3] [--threads 1] [--clock cpu|wall] [--dry]

Both run greedy, fp32, on the same weights, alternately (so load from other processes hits both alike); each
number is the median over --repeats. Decode tokens/s = (N - 1) new tokens per row / (time of a generation
of N tokens - time of a generation of 1 token), i.e. the prefill is subtracted out. Prefill tokens/s = prompt
tokens / time of a generation of one token. Both generate the same token ids (checked and printed).

--clock cpu (default) times with this process's CPU time on one thread: on a machine shared with other jobs,
wall time mostly measures how often the scheduler runs us, CPU time measures the work each side does.
--clock wall with --threads 0 (torch's default) is the number a user sees on an idle machine.
"""

import statistics
from functools import partial

import torch

from benchmarks.common import CLOCKS, decode_rates, hf_greedy, interleaved, make_parser, model_cfg, ours_greedy, parse
from speedllm.models import Qwen3, num_params
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config

PROMPT_LEN, PREFILL_LEN = 16, 512


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    args = parse(parser, argv, new_tokens=4, repeats=1)
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import Qwen3ForCausalLM

    cfg = model_cfg("tiny" if args.dry else "vocab_32k")
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(hf_config(cfg)).eval()
    ours = Qwen3(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    print(f"model: {num_params(ours) / 1e6:.1f}M parameters, fp32, {torch.get_num_threads()} threads, "
          f"{args.clock} clock")

    runners = {"transformers": hf_greedy(hf), "speedllm": ours_greedy(ours)}
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in (1, 8):
        prompt = torch.randint(0, cfg.vocab_size, (batch, PROMPT_LEN), generator=gen)
        decode, ids = decode_rates(runners, prompt, args.new_tokens, args.repeats, clock)
        rows.append((f"decode tokens/s, batch {batch}", decode, ids["transformers"] == ids["speedllm"]))
    prompt = torch.randint(0, cfg.vocab_size, (1, PREFILL_LEN), generator=gen)
    times, _ = interleaved({name: partial(fn, prompt, 1) for name, fn in runners.items()}, args.repeats, clock)
    rows.append((f"prefill tokens/s, 1 x {PREFILL_LEN}",
                 {name: PREFILL_LEN / statistics.median(t) for name, t in times.items()}, None))

    print("| metric | transformers | speedllm | ratio | same ids |\n|---|---|---|---|---|")
    for metric, values, same in rows:
        ratio = values["speedllm"] / values["transformers"]
        print(f"| {metric} | {values['transformers']:.1f} | {values['speedllm']:.1f} | {ratio:.2f}x | "
              f"{'-' if same is None else same} |")
