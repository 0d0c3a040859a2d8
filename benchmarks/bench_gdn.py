"""The gated delta rule (Gated DeltaNet's token mixer) on CPU: forward+backward time and peak memory of the cpu op
set's chunked form against transformers' torch fallback and our reference twin, fp32 and bf16, and its growth
with length.

    python -m benchmarks gdn [--batch 4] [--seq-lens 512,2048] [--long 8192] [--heads 8] [--key-heads 4]
                             [--dim 64] [--repeats 3] [--threads N] [--dry]

One call: the op on [batch, seq, heads, dim] inputs (q and k with --key-heads heads, g in the model's range, no
initial state), then backward of a fixed random projection of its output. The three implementations alternate
(interleaved repeats after a warm-up, median), timed in process CPU seconds (all threads), which a loaded machine
distorts less than wall time. Peak memory is torch's MemTracker over one call (tensor bytes allocated by the call:
saved activations and temporaries; the inputs are outside it). In bf16, q, k, v and beta are bf16 (g fp32), as
the model passes them under autocast. The length scaling times ours alone at --long tokens and at the longest of
--seq-lens, interleaved (linear cost: the ratio of the lengths).
"""

import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import MiB, interleaved, make_parser, parse, peak_tensor_bytes
from speedllm.native import cpu_name
from speedllm.ops import get_ops


def inputs(args, seq: int, dtype):
    gen = torch.Generator().manual_seed(0)
    B, H, Hk, D = args.batch, args.heads, args.key_heads, args.dim
    q, k = (torch.randn(B, seq, Hk, D, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(B, seq, H, D, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(B, seq, H, generator=gen))
    beta = torch.rand(B, seq, H, generator=gen).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)], torch.randn(B, seq, H, D, generator=gen)


def runners(args, seq: int, dtype) -> dict:
    """{name: one forward+backward} of each implementation on the same inputs."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    tensors, weight = inputs(args, seq, dtype)

    def step(fn):
        out, _ = fn(*tensors)
        (out.float() * weight).sum().backward()
        for x in tensors:
            x.grad = None

    ops = {"ours": get_ops("cpu").chunk_gated_delta_rule, "reference": get_ops("reference").chunk_gated_delta_rule,
           "transformers": lambda *x: torch_chunk_gated_delta_rule(*x, output_final_state=True,
                                                                   use_qk_l2norm_in_kernel=True)}
    return {name: (lambda fn=fn: step(fn)) for name, fn in ops.items()}


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-lens", default="512,2048", help="comma-separated sequence lengths")
    parser.add_argument("--long", type=int, default=8192, help="length of the scaling measurement")
    parser.add_argument("--heads", type=int, default=8, help="value heads")
    parser.add_argument("--key-heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="key and value head dim")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parse(parser, argv, batch=1, seq_lens="64,100", long=256, heads=2, key_heads=1, dim=16, repeats=1)
    torch.set_num_threads(args.threads)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for seq in seq_lens:
            fns = runners(args, seq, dtype)
            times, _ = interleaved(fns, args.repeats, time.process_time, warmup=1)
            t = {name: statistics.median(v) for name, v in times.items()}
            peaks = {name: peak_tensor_bytes(fn) / MiB for name, fn in fns.items()}
            rows.append(f"| {str(dtype).removeprefix('torch.')} | {seq} | {t['ours']:.3f} | {t['transformers']:.3f} | "
                        f"{t['reference']:.3f} | x{t['transformers'] / t['ours']:.2f} | {peaks['ours']:.0f} | "
                        f"{peaks['transformers']:.0f} | {peaks['reference']:.0f} |")
    print(f"gated delta rule forward+backward, batch {args.batch}, {args.heads} value / {args.key_heads} key heads "
          f"of {args.dim}; {cpu_name()}, {args.threads} threads, torch {torch.__version__}")
    print("| dtype | seq | ours s | transformers s | reference s | transformers / ours | ours peak MiB | "
          "transformers peak MiB | reference peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    base = max(seq_lens)
    for dtype in (torch.float32, torch.bfloat16):
        fns = {seq: runners(args, seq, dtype)["ours"] for seq in (base, args.long)}
        times, _ = interleaved(fns, args.repeats, time.process_time, warmup=1)
        ratio = statistics.median(times[args.long]) / statistics.median(times[base])
        print(f"length scaling, ours, {str(dtype).removeprefix('torch.')}: time at {args.long} / time at {base} = "
              f"{ratio:.2f} (linear: {args.long / base:.2f}; interleaved)", flush=True)
