"""Muon vs AdamW on the demo: final validation loss of `python launch.py optim=<name>` at a few peak lrs.

Every run is the default demo (qwen3_tiny, the bundled corpus, train.steps=400, the same batch, seed and
schedule) with only the optimizer and its peak lr changed; min_lr stays a tenth of the peak, as in both
defaults. Runs go one after another, each in its own `launch.py` process; a run already in --out is
read back instead of run again, so an interrupted sweep continues where it stopped.

    python -m benchmarks muon                           # both defaults and a 3-lr sweep of each
    python -m benchmarks muon --optims muon --lrs 0.01,0.02,0.04 --steps 400
    python -m benchmarks muon --report                  # the table of the runs so far (a run in progress too)
    python -m benchmarks muon --dry                     # 2 steps of a 64-wide model, one lr each
"""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import make_parser, parse

ROOT = Path(__file__).resolve().parents[1]
# peak lrs swept per optimizer; the middle one is the optimizer's documented default (conf/optim/<name>.yaml)
SWEEP = {"adamw": [1e-3, 3e-3, 1e-2], "muon": [1e-2, 2e-2, 4e-2]}
DRY = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2", "model.head_dim=16",
       "train.seq_len=32", "train.eval_every=2", "train.eval_steps=1", "hardware=cpu"]


def run_dir_of(out: Path, optim: str, lr: float, steps: int) -> Path:
    return out / f"{optim}_lr{lr:g}_steps{steps}"


def valid_losses(run_dir: Path) -> dict:
    """{step: validation loss} of the run so far (the demo evaluates every 100 steps)."""
    metrics = run_dir / "metrics.jsonl"
    records = map(json.loads, metrics.read_text().splitlines()) if metrics.is_file() else []
    return {r["step"]: r["loss"] for r in records if r.get("split") == "valid"}


def train(out: Path, optim: str, lr: float, steps: int, report: bool, extra: list) -> dict:
    run_dir = run_dir_of(out, optim, lr, steps)
    if report or steps in valid_losses(run_dir):
        return valid_losses(run_dir)
    cmd = [sys.executable, str(ROOT / "launch.py"), f"optim={optim}", f"optim.lr={lr}", f"optim.min_lr={lr / 10:g}",
           f"train.steps={steps}", "generate.num_samples=0",
           "checkpoint.save_final=false", "logging.tensorboard=false", "logging.progress_bar=false",
           f"hydra.run.dir={run_dir}", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return valid_losses(run_dir)


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--optims", default="adamw,muon")
    parser.add_argument("--lrs", default=None, help="comma-separated peak lrs (default: each optimizer's sweep)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_muon")
    parser.add_argument("--report", action="store_true", help="run nothing: the table of what --out holds so far")
    args = parse(parser, argv)  # --dry: 2 steps of a 64-wide model, one lr each, into ./bench_muon_dry
    if args.dry:
        args.steps, args.lrs, args.out = 2, None, Path("bench_muon_dry").absolute()
    rows = []
    for optim in args.optims.split(","):
        lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else SWEEP[optim][1:2] if args.dry else SWEEP[optim]
        for lr in lrs:
            rows.append((optim, lr, train(args.out, optim, lr, args.steps, args.report, DRY if args.dry else [])))
            print(f"{optim:<6} lr={lr:<8g} valid loss by step: {rows[-1][2]}", flush=True)
    steps = sorted({step for _, _, losses in rows for step in losses})
    print("\n| optimizer | peak lr | " + " | ".join(f"valid loss @ {s}" for s in steps) + " |")
    print("|---|---:|" + "---:|" * len(steps))
    for optim, lr, losses in rows:
        print(f"| {optim} | {lr:g} | " + " | ".join(f"{losses[s]:.4f}" if s in losses else "-" for s in steps) + " |")


if __name__ == "__main__":
    main()
