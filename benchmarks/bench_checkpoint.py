"""Training stall of a checkpoint save: synchronous DCP save against checkpoint.async_save (single process).

    python -m benchmarks checkpoint [--layers 4] [--repeat 3] [--model qwen3_0.6b] [--dry]

A Qwen3 of qwen3_0.6b's width with --layers layers at the demo vocabulary (8192) and its AdamW state after one
step (weights + two moments: ~0.85 GB at 4 layers) is saved with speedllm.checkpoint.dcp.Checkpointer, sync and
async in turn (interleaved, --repeat times). One Checkpointer per mode saves steps 1..--repeat, as in a run (the
async one keeps its staging buffers). "stall" is the time `save` blocks the caller (what the training loop waits);
"written" is the time until the checkpoint is published (for async, by the background thread).
"""

import shutil
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.common import REPO, make_parser, parse
from speedllm.checkpoint.dcp import Checkpointer
from speedllm.config import compose_config
from speedllm.models.qwen3 import Qwen3


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="qwen3_0.6b", help="whose width (conf/model/<name>.yaml)")
    args = parse(parser, argv, layers=1, repeat=1, model="qwen3_tiny")
    cfg = compose_config(f"model={args.model}", "model.vocab_size=8192", f"model.num_hidden_layers={args.layers}")
    model = Qwen3(cfg.model)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 8192, (1, 32))
    ce, aux = model(tokens, labels=tokens)
    (ce + aux).backward()
    optimizer.step()
    state_mb = sum(t.numel() * t.element_size() for t in [*model.parameters(), *(
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))]) / 2**20
    print(f"{args.layers} layers: model + AdamW state {state_mb:.0f} MiB")
    results = {"sync": [], "async": []}
    roots = {mode: Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=REPO)) for mode in results}
    checkpointers = {mode: Checkpointer(str(roots[mode]), keep=1, async_save=mode == "async") for mode in results}
    for step in range(1, args.repeat + 1):
        for mode, checkpointer in checkpointers.items():
            start = time.perf_counter()
            checkpointer.save(step, model, optimizer, {"step": step}, OmegaConf.create({}))
            stall = time.perf_counter() - start
            checkpointer.wait()
            results[mode].append((stall, time.perf_counter() - start))
    for root in roots.values():
        shutil.rmtree(root)
    for mode, runs in results.items():
        stalls, totals = [s for s, _ in runs], [t for _, t in runs]
        print(f"{mode:5s} stall s: {' '.join(f'{s:.2f}' for s in stalls)}  (min {min(stalls):.2f})   "
              f"written s: {' '.join(f'{t:.2f}' for t in totals)}")
    best = {mode: min(stall for stall, _ in runs) for mode, runs in results.items()}
    print(f"stall async / sync (best of each): {best['async'] / best['sync']:.2f}")
