"""Context parallelism in every parallel.cp_mode trains like the single process.

Three SFT steps of a small qwen3_tiny at seq_len 512 (the bundled SFT demo set) under cp2 for each cp_mode,
packed and unpacked, under cp4 for each cp_mode packed, and cp2 with qwen3_moe_tiny, must give the single process'
losses within 1e-5 (relative). One spawned job per cp size runs all of its layouts in turn (one process group), through
the training loop the launcher runs; the references run the same loop in this process.
"""

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from speedllm.config import compose_config
from speedllm.config.validate import validate
from speedllm.errors import UserError
from speedllm.parallel.context import CP_MODES

DENSE = ["model=qwen3_tiny", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
         "model.head_dim=16"]
MOE = ["model=qwen3_moe_tiny", "model.hidden_size=64", "model.moe_intermediate_size=32",
       "model.num_hidden_layers=2", "model.head_dim=16"]
RUN = ["hardware=cpu", "hardware.dtype=float32", "task=sft", "data=sft_demo", "train.seq_len=512", "train.micro_batch_size=1",
       "train.global_batch_size=2", "train.steps=3", "train.log_every=1", "train.eval_every=0",
       "optim.warmup_steps=2", "optim.schedule=constant", "logging.progress_bar=false",
       "logging.tensorboard=false", "generate.num_samples=0", "checkpoint.save_final=false"]
PACKING = {"packed": ["data.packing=true"], "unpacked": ["data.packing=false"]}


def config(run_dir: Path, overrides):
    cfg = compose_config(*RUN, *overrides, f"run_dir={run_dir}", "parallel.dp=1")
    OmegaConf.resolve(cfg)
    return cfg


def train(run_dir: Path, overrides, rank=0, world_size=1) -> None:
    """The task as a launched rank runs it (speedllm.launcher.run_task), on this process' group."""
    from speedllm.launcher import run_task
    from speedllm.parallel.mesh import build_mesh
    from speedllm.runtime import Runtime

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config(run_dir, overrides)
    mesh = build_mesh(cfg.parallel, "cpu") if world_size > 1 else None
    run_task(cfg, Runtime(rank=rank, world_size=world_size, local_rank=rank, mesh=mesh, ep=cfg.parallel.ep))


def losses(run_dir: Path) -> list:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "split" not in r]


def _rank(rank: int, world_size: int, port: int, jobs) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    for run_dir, overrides in jobs:
        train(run_dir, overrides, rank, world_size)
    dist.barrier()
    dist.destroy_process_group()


def layouts(cp: int) -> dict:
    packings = PACKING if cp == 2 else {"packed": PACKING["packed"]}  # cp4: the document-aware path only
    out = {f"cp{cp}_{mode}_{packing}": [*DENSE, f"parallel.cp={cp}", f"parallel.cp_mode={mode}", *extra]
           for mode in CP_MODES for packing, extra in packings.items()}
    if cp == 2:
        out["cp2_ring_moe"] = [*MOE, "parallel.cp=2", "parallel.cp_mode=ring", *PACKING["packed"]]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    for name, overrides in {"single_packed": [*DENSE, *PACKING["packed"]],
                            "single_unpacked": [*DENSE, *PACKING["unpacked"]],
                            "single_moe": [*MOE, *PACKING["packed"]]}.items():
        train(root / name, overrides)
    for cp in (2, 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        jobs = [(root / name, overrides) for name, overrides in layouts(cp).items()]
        mp.spawn(_rank, args=(cp, port, jobs), nprocs=cp)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", [*layouts(2), *layouts(4)])
def test_cp_mode_matches_single_process(name, runs):
    reference = "single_moe" if name.endswith("moe") else f"single_{name.rsplit('_', 1)[1]}"
    expected, got = losses(runs / reference), losses(runs / name)
    assert len(got) == len(expected) == 3
    for a, b in zip(got, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (name, got, expected)


def test_cp_rules_rejected_before_launch():
    def message(*overrides):
        with pytest.raises(UserError) as err:
            validate(config(Path("/tmp"), [*DENSE, *overrides]), 4, 4)
        return str(err.value)

    assert "use parallel.pp=1 with cp" in message("parallel.cp=2", "parallel.pp=2")
    # qwen3_tiny has 4 heads: ulysses over 8 ranks cannot split them
    assert "parallel.cp=8 must divide the attention heads" in message("parallel.cp=8", "parallel.cp_mode=ulysses")
    assert "parallel.cp_ulysses=3 must be a divisor" in message("parallel.cp=4", "parallel.cp_mode=hybrid",
                                                                 "parallel.cp_ulysses=3")
