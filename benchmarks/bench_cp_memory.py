"""Per-rank peak memory of context parallel training against the planner, for BENCHMARKS.md.

    python benchmarks/bench_cp_memory.py [--seq-len 4096] [--cp 1 2 4] [--modes ring ulysses]

qwen3_tiny, one micro-batch of seq_len tokens per step, spawned CPU ranks (gloo); measured as the planner's
own tests measure (speedllm.planner.measure: peak live tensor bytes over a second training step).
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedllm.config import compose_config  # noqa: E402
from speedllm.planner.layout import layout_from_config  # noqa: E402
from speedllm.planner.measure import measure_layout, measure_training_step  # noqa: E402
from speedllm.planner.search import Planner, problem_from_config  # noqa: E402

MiB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["ring", "ulysses"])
    args = parser.parse_args()
    print(f"qwen3_tiny, seq_len {args.seq_len}, micro batch 1, fp32, reference ops")
    print("| cp | cp_mode | rank | measured peak MiB | predicted MiB | predicted / measured |")
    print("|---|---|---|---|---|---|")
    for cp in args.cp:
        for mode in args.modes if cp > 1 else ["-"]:
            overrides = ["model=qwen3_tiny", "hardware=cpu", f"train.seq_len={args.seq_len}",
                         "train.micro_batch_size=1", "train.global_batch_size=1", "parallel.dp=1",
                         f"parallel.cp={cp}"] + ([f"parallel.cp_mode={mode}"] if cp > 1 else [])
            cfg = compose_config(*overrides)
            with tempfile.TemporaryDirectory() as out:
                if cp == 1:
                    from speedllm.runtime import Runtime

                    cfg.run_dir = out
                    records = [measure_training_step(cfg, Runtime())]
                else:
                    records = measure_layout(cfg, cp, out)
            planner = Planner(problem_from_config(cfg, cp))
            predicted = planner.rank_memories(layout_from_config(cfg.parallel, cfg.train))[0].total
            for rec in records:
                print(f"| {cp} | {mode} | {rec['rank']} | {rec['peak'] / MiB:.1f} | {predicted / MiB:.1f} | "
                      f"{predicted / rec['peak']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
