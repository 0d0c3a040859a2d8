"""Per-rank peak memory of Gated DeltaNet layers under context parallelism, for docs/benchmarks/hybrid.md.

    python -m benchmarks gdn_cp [--seq-len 16384] [--cp 1 2 4] [--mode ring] [--dry]

A stack of Gated DeltaNet layers only (qwen3_5_tiny's sizes, 2 layers, fp32, CPU ops), batch 1:
one forward+backward per cp size on spawned CPU ranks (gloo), speedllm.parallel.context hooking the model as
training does. Peak: live tensor bytes during the step (speedllm.planner.measure.PeakTensorMemory), the weights
included; the loss in chunks of 256 tokens, so the peak is the layers'. The loss is the whole sequence's on every rank; it must equal cp=1's.
Targets at seq 16384: cp2 <= 0.6x, cp4 <= 0.35x of cp1's peak.
--dry: seq_len 256, cp 1 and 2.
"""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import MiB, free_port, make_parser, parse
from speedllm.config import compose_config
from speedllm.models.qwen3 import Qwen3
from speedllm.planner.measure import PeakTensorMemory

LOSS_CHUNK = 256  # tokens per loss chunk: the logits' share of the peak stays small beside the layers'
MODEL = ["model=qwen3_5_tiny", "model.num_hidden_layers=2", "model.layer_types=[linear_attention,linear_attention]"]


def step(seq_len: int, cp_mesh=None, mode: str = "ring") -> tuple:
    """(loss, peak bytes) of one forward+backward on this rank."""
    torch.manual_seed(0)
    model = Qwen3(compose_config(*MODEL).model, ops="cpu", loss_chunk_size=LOSS_CHUNK)
    gen = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, model.cfg.vocab_size, (2, 1, seq_len), generator=gen)
    if cp_mesh is not None:
        from speedllm.parallel.context import apply_cp

        apply_cp(model, cp_mesh, mode, cp_mesh.size() if mode == "ulysses" else 1)
    tracker = PeakTensorMemory(existing=list(model.parameters()))
    with tracker:
        loss, _ = model(tokens, labels=labels)
        loss.backward()
    return loss.item(), tracker.peak


def _rank(rank: int, world: int, port: int, seq_len: int, mode: str, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out[rank] = step(seq_len, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"], mode)
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--mode", default="ring")
    args = parse(parser, argv, seq_len=256, cp=[1, 2])
    print(f"2 Gated DeltaNet layers (qwen3_5_tiny sizes), seq_len {args.seq_len}, batch 1, fp32, cp_mode {args.mode}")
    print("| cp | max rank peak MiB | / cp1 | loss (CE sum) | relative to cp1 |")
    print("|---|---|---|---|---|")
    base = None
    for cp in args.cp:
        if cp == 1:
            results = [step(args.seq_len)]
        else:
            results = mp.Manager().dict()
            mp.spawn(_rank, args=(cp, free_port(), args.seq_len, args.mode, results), nprocs=cp)
            results = [results[r] for r in range(cp)]
        loss, peak = results[0][0], max(p for _, p in results)
        base = base or (loss, peak)
        print(f"| {cp} | {peak / MiB:.1f} | {peak / base[1]:.3f} | {loss:.6f} | {(loss - base[0]) / base[0]:.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
