"""Training stall of a checkpoint save: synchronous DCP save against checkpoint.async_save (single process).

    python -m benchmarks checkpoint [--layers 4] [--repeat 3] [--model qwen3_0.6b] [--s3] [--dry]

A Qwen3 of qwen3_0.6b's width with --layers layers at the demo vocabulary (8192) and its AdamW state after one
step (weights + two moments: ~0.85 GB at 4 layers) is saved with speedllm.checkpoint.dcp.Checkpointer, sync and
async in turn (interleaved, --repeat times). One Checkpointer per mode saves steps 1..--repeat, as in a run (the
async one keeps its staging buffers). "stall" is the time `save` blocks the caller (what the training loop waits);
"written" is the time until the checkpoint is published (for async, by the background thread).

--s3 adds an async save to s3:// (speedllm.storage): to the S3 store the environment names (AWS_ENDPOINT_URL and
credentials), else to moto's S3 server started on localhost for the run (the test extra installs it).
"""

import os
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.common import REPO, make_parser, parse
from speedllm import storage
from speedllm.checkpoint.dcp import Checkpointer
from speedllm.config import compose_config
from speedllm.models.qwen3 import Qwen3


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="qwen3_0.6b", help="whose width (conf/model/<name>.yaml)")
    parser.add_argument("--s3", action="store_true", help="also an async save to s3:// (see above)")
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
    results = {"sync": [], "async": [], **({"async_s3": []} if args.s3 else {})}
    roots = {mode: Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=REPO)) for mode in ("sync", "async")}
    if args.s3:
        roots["async_s3"] = f"s3://{s3_bucket()}/ckpt-{os.getpid()}"
    checkpointers = {mode: Checkpointer(str(roots[mode]), keep=1, async_save=mode != "sync") for mode in results}
    try:
        for step in range(1, args.repeat + 1):
            for mode, checkpointer in checkpointers.items():
                start = time.perf_counter()
                checkpointer.save(step, model, optimizer, {"step": step}, OmegaConf.create({}))
                stall = time.perf_counter() - start
                checkpointer.wait()
                results[mode].append((stall, time.perf_counter() - start))
    finally:
        for root in roots.values():
            if storage.exists(root):
                storage.remove(root)
    for mode, runs in results.items():
        stalls, totals = [s for s, _ in runs], [t for _, t in runs]
        print(f"{mode:5s} stall s: {' '.join(f'{s:.2f}' for s in stalls)}  (min {min(stalls):.2f})   "
              f"written s: {' '.join(f'{t:.2f}' for t in totals)}")
    best = {mode: min(stall for stall, _ in runs) for mode, runs in results.items()}
    print(f"stall async / sync (best of each): {best['async'] / best['sync']:.2f}")
    if args.s3:
        print(f"stall async s3 / async local disk (best of each): {best['async_s3'] / best['async']:.2f}")


def s3_bucket() -> str:
    """A bucket on the S3 store the environment names, else on moto's server started here on localhost."""
    if "AWS_ENDPOINT_URL" not in os.environ:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{server.get_host_and_port()[1]}",
                          AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    fs, _ = storage.filesystem("s3://speedllm-bench")
    if not fs.exists("speedllm-bench"):
        fs.mkdir("speedllm-bench")
    return "speedllm-bench"
