"""Per-rank peak memory of context parallel training against the planner, for BENCHMARKS.md.

    python -m benchmarks cp_memory [--seq-len 4096] [--cp 1 2 4] [--modes ring ulysses] [--dry]

qwen3_tiny, one micro-batch of seq_len tokens per step, spawned CPU ranks (gloo); measured as the planner's
own tests measure (speedllm.planner.measure: peak live tensor bytes over a second training step).
"""

from benchmarks.common import MiB, make_parser, measured_step, parse
from speedllm.config import compose_config
from speedllm.planner.layout import layout_from_config
from speedllm.planner.search import Planner, problem_from_config


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["ring", "ulysses"])
    args = parse(parser, argv, seq_len=128, cp=[1, 2], modes=["ring"])
    print(f"qwen3_tiny, seq_len {args.seq_len}, micro batch 1, fp32, reference ops")
    print("| cp | cp_mode | rank | measured peak MiB | predicted MiB | predicted / measured |")
    print("|---|---|---|---|---|---|")
    for cp in args.cp:
        for mode in args.modes if cp > 1 else ["-"]:
            overrides = ["model=qwen3_tiny", "hardware=cpu", f"train.seq_len={args.seq_len}",
                         "train.micro_batch_size=1", "train.global_batch_size=1", "parallel.dp=1",
                         f"parallel.cp={cp}"] + ([f"parallel.cp_mode={mode}"] if cp > 1 else [])
            cfg = compose_config(*overrides)
            records = measured_step(cfg, cp)
            planner = Planner(problem_from_config(cfg, cp))
            predicted = planner.rank_memories(layout_from_config(cfg.parallel, cfg.train))[0].total
            for rec in records:
                print(f"| {cp} | {mode} | {rec['rank']} | {rec['peak'] / MiB:.1f} | {predicted / MiB:.1f} | "
                      f"{predicted / rec['peak']:.3f} |", flush=True)
