"""GEMMs at the 41.6M benchmark model's shapes: the batch-invariant mode's kernels (bf16: AMX tiles where the CPU has
them, else AVX512-BF16; fp32: FMA lanes; portable lanes off the avx512 path) against torch.mm (oneDNN), and against
the probe's peak of the dtype.

    python -m benchmarks gemm [--dtype bfloat16] [--tokens 1024] [--paths native avx512 avx2] [--repeats 5]
                              [--threads N] [--dry]

Each projection of vocab_32k (hidden 512, MLP 1536, 8 heads of 64, 4 KV heads, vocab 32,000) at --tokens rows (the
training batch, 4 x 256), as the training step multiplies it: the forward x W^T (W a linear weight, read in its
own [out, in] layout), the input gradient dy W, the weight gradient dy^T x (dy transposed in place); and the
decode step of the output layer (one row). Operands are --dtype tensors in those layouts, as the mode receives them.
torch and every --paths row take turns within each repeat (median of --repeats after a warm call), wall clock at
--threads threads. `native` is the best path here (AMX where granted); the others are forced with
SPEEDLLM_CPU_ISA. The peak is speedllm.hardware's GEMM probe of --dtype (torch.mm at 256 x 1024 x 1024, cached
per machine).
"""

import statistics
import time

import torch

from benchmarks.common import CONFIGS, interleaved, make_parser, on_path, parse
from speedllm.hardware import cpu_probe
from speedllm.native import cpu_name, supported_isas
from speedllm.ops import batch_invariant as bi


def shapes(cfg: dict, tokens: int) -> list:
    """(name, M, K, N, a layout, b layout) per product: `t` a transposed view, `c` contiguous."""
    D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    rows = []
    for name, n_in, n_out in [("q/o", D, D), ("k/v", D, kv), ("gate/up", D, F), ("down", F, D), ("lm head", D, V)]:
        rows += [(f"{name} fwd", tokens, n_in, n_out, "c", "t"), (f"{name} dx", tokens, n_out, n_in, "c", "c"),
                 (f"{name} dw", n_out, tokens, n_in, "t", "c")]
    return rows + [("lm head decode", 1, D, V, "c", "t")]


def operand(rows: int, cols: int, layout: str, dtype, gen) -> torch.Tensor:
    if layout == "t":
        return torch.randn(cols, rows, generator=gen).to(dtype).t()
    return torch.randn(rows, cols, generator=gen).to(dtype)


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--tokens", type=int, default=1024, help="rows of a training step's activations")
    parser.add_argument("--paths", nargs="+", default=["native", *supported_isas()[1:2]],
                        help="kernel paths to time: native, or one of SPEEDLLM_CPU_ISA's")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parse(parser, argv, tokens=16, repeats=1)
    torch.set_num_threads(args.threads)
    model = "tiny" if args.dry else "vocab_32k"
    cfg = CONFIGS[model]
    peak, dtype = cpu_probe()[args.dtype], getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.dtype} GEMMs of {model} at {args.tokens} tokens; {cpu_name()}, {args.threads} threads, torch "
          f"{torch.__version__}; native bf16 path: {bi.bf16_path()}; probe {args.dtype} peak {peak:.0f} GFLOP/s")
    head = " | ".join(f"{p} GFLOP/s | {p}/torch | {p}/peak" for p in args.paths)
    print(f"| product | M x K x N | torch GFLOP/s | {head} |")
    print("|---|---|---|" + "---|---|---|" * len(args.paths))
    total = {name: 0.0 for name in ["torch", *args.paths]}
    for name, M, K, N, la, lb in shapes(cfg, args.tokens):
        a, b = operand(M, K, la, dtype, gen), operand(K, N, lb, dtype, gen)
        fns = {"torch": lambda: torch.mm(a, b), **{p: on_path(p, lambda: bi.mm(a, b)) for p in args.paths}}
        times, _ = interleaved(fns, args.repeats, time.perf_counter, warmup=1)
        t = {k: statistics.median(v) for k, v in times.items()}
        for k in total:
            total[k] += t[k]
        rate = {k: 2 * M * K * N / s / 1e9 for k, s in t.items()}
        cells = " | ".join(f"{rate[p]:.0f} | x{rate[p] / rate['torch']:.2f} | {rate[p] / peak:.0%}" for p in args.paths)
        print(f"| {name} | {M} x {K} x {N} | {rate['torch']:.0f} | {cells} |")
    print("all products (seconds, the training step's share): " + ", ".join(
        f"{k} {s:.4f}" for k, s in total.items()) + " | " + ", ".join(
        f"{p}/torch x{total['torch'] / total[p]:.2f}" for p in args.paths))


if __name__ == "__main__":
    main()
