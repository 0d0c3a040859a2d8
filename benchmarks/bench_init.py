"""Peak host memory (RSS) of every rank of a from-scratch FSDP run: does rank 0 need more than the others?

    python -m benchmarks init [--code DIR] [--dry] [launch.py overrides ...]

Runs `python launch.py` of the code in DIR (default: this checkout; point it at an extracted older commit to
compare) and, from outside, samples the peak RSS (VmHWM in /proc/<pid>/status) of every worker it starts,
naming each by the RANK in its environment. The default overrides are the issue's case: qwen3_0.6b at the
demo tokenizer's 8192-entry vocabulary (with that tokenizer), FSDP over 8 ranks, SGD without momentum
(state = weights + gradients), one step at train.seq_len=32. --dry: qwen3_tiny over 2 ranks.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, make_parser, parse, proc_status_kib

CASE = ["model=qwen3_0.6b", "model.vocab_size=8192", "model.tokenizer=${asset:tokenizers/demo}", "parallel=fsdp8",
        "optim=sgd", "hardware=cpu", "train.steps=1", "train.seq_len=32", "train.micro_batch_size=1",
        "train.global_batch_size=8", "train.eval_every=0", "checkpoint.save_final=false", "generate.num_samples=0",
        "logging.progress_bar=false", "logging.tensorboard=false"]
DRY = ["model=qwen3_tiny", "parallel=fsdp2", "train.global_batch_size=2"]


def descendants(pid: int) -> list:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    children = [int(p) for p in out]
    return children + [d for c in children for d in descendants(c)]


def rank_and_peak(pid: int):
    """(RANK from the environment or None, VmHWM in MiB) of a live process, or None if it is gone."""
    try:
        env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        return env.get("RANK"), proc_status_kib("VmHWM", pid) / 1024
    except OSError:
        return None


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--code", type=Path, default=REPO, help="checkout whose launch.py runs")
    parser.add_argument("overrides", nargs="*", help="launch.py overrides after the default case")
    args = parse(parser, argv)
    overrides = (DRY if args.dry else []) + args.overrides
    run_dir = Path(tempfile.mkdtemp(prefix="bench_init_"))
    env = {**os.environ, "PYTHONPATH": str(args.code.resolve())}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(args.code / "launch.py"), f"hydra.run.dir={run_dir}", *CASE,
                             *overrides], cwd=run_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    peaks = {}
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            seen = rank_and_peak(pid)
            if seen is not None and seen[0] is not None:
                peaks[seen[0]] = max(peaks.get(seen[0], 0.0), seen[1])
        time.sleep(0.2)
    output = proc.stdout.read()
    if proc.returncode != 0:
        sys.exit(output[-3000:])
    print(f"code {args.code.resolve()}: {time.perf_counter() - start:.0f} s")
    loss = [line for line in output.splitlines() if "loss" in line]
    print(loss[-1] if loss else "")
    ranks = sorted(peaks, key=int)
    print("rank        " + " ".join(f"{r:>7}" for r in ranks))
    print("peak RSS MiB" + " ".join(f"{peaks[r]:7.0f}" for r in ranks))
    others = [peaks[r] for r in ranks if r != "0"]
    print(f"rank 0 / max(other ranks) = {peaks['0'] / max(others):.2f}   rank 0 / mean(other ranks) = "
          f"{peaks['0'] / (sum(others) / len(others)):.2f}")
