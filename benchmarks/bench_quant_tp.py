"""Quantized decode under tensor parallelism: parallel.tp=2 vs tp=1 at the same precision, batch 1.

    python -m benchmarks quant_tp [--quants none int8_wo int4_wo] [--new-tokens 16] [--repeats 5] [--dry]

`generate`'s ~40M Qwen3 with random weights, saved once as an HF directory and loaded by the inference
path (speedllm.generation.load.load_model: under tp=2 each rank quantizes its own shards). Two gloo ranks with one
thread each: in every repeat rank 0 first decodes alone at tp=1 (rank 1 waits), then both decode at tp=2, so
load from other processes hits both alike. Decode tokens/s = (N - 1) / (wall time of N new tokens - of 1), the
median over --repeats (wall time: a tp=2 step includes its all-reduces). --dry: the `tiny` config, fp32.
"""

import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import free_port, make_parser, model_cfg, ours_greedy, parse, timed
from speedllm.config import compose_config
from speedllm.runtime import Runtime

PROMPT_BS = torch.arange(100, 116)[None]


def load(root: Path, quant: str, tp: int):
    from speedllm.generation.load import load_model
    from speedllm.parallel.mesh import build_mesh

    cfg = compose_config("task=generate", "hardware=cpu", "hardware.dtype=float32", "model=hf",
                         f"checkpoint.load_hf={root}", f"run_dir={root}", f"quant={quant}", "quant.group_size=64",
                         "parallel=tp2" if tp == 2 else "parallel=single")
    mesh = build_mesh(cfg.parallel, "cpu") if tp == 2 else None
    return load_model(cfg, Runtime(rank=dist.get_rank(), world_size=tp, mesh=mesh))


def seconds(model, new_tokens: int, tp: int) -> float:
    return timed(lambda: ours_greedy(model, tp=tp)(PROMPT_BS, new_tokens))[0]


def _rank(rank: int, port: int, root: Path, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    for quant in args.quants:
        single = load(root, quant, 1) if rank == 0 else None
        tp2 = load(root, quant, 2)
        rates = {1: [], 2: []}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for tp, model in ((1, single), (2, tp2)):
                if model is not None:
                    times = [seconds(model, n, tp) for n in (1, args.new_tokens)]
                    if repeat:
                        rates[tp].append((args.new_tokens - 1) / (times[1] - times[0]))
                dist.barrier()
        if rank == 0:
            tp1, tp2_rate = statistics.median(rates[1]), statistics.median(rates[2])
            print(f"{quant:9s} tp=1 {tp1:7.1f} tok/s   tp=2 {tp2_rate:7.1f} tok/s   tp2/tp1 x{tp2_rate / tp1:.2f}",
                  flush=True)
    dist.destroy_process_group()


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--quants", nargs="+", default=["none", "int8_wo", "int4_wo"])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parse(parser, argv, quants=["none"], new_tokens=2, repeats=1)
    from transformers import Qwen3ForCausalLM

    from speedllm.models.hf_adapter import hf_config

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen3ForCausalLM(hf_config(model_cfg("tiny" if args.dry else "vocab_32k"))).save_pretrained(tmp)
        mp.spawn(_rank, args=(free_port(), Path(tmp), args), nprocs=2)
