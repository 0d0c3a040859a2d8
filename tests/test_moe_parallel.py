"""MoE models on pipeline stages train like the single process (the load-balancing loss spans every stage).

A 4-layer qwen3_moe_tiny whose layer 0 is dense (mlp_only_layers), with router_aux_loss_coef=1 so that the
load-balancing gradients weigh, runs 5 steps of a global batch of 8 sequences under pp2 x dp2 with ep2 and FSDP
(4 ranks, 1F1B), pp2 with parallel.pp_layers=[1, 3] (the first stage has no MoE layer: it passes zero statistics
on), pp2 with 2 virtual stages per rank (Interleaved1F1B) and the V-shaped ZBVZeroBubble: losses within 1e-5
(relative) of the single process, parameters after step 5 within 1e-4. The pp2 x ep2 checkpoint then resumes
under FSDP over 2 ranks and under one process with the single run's step-6 loss. Before training, each pipeline
layout's evaluation forward (Pipeline.forward_only) gives the single process' (ce_sum, aux) for one batch.
One spawned job per world size runs its layouts in turn (one process group), through the training loop the
launcher runs; the references run in this process.
"""

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from test_parallel import RUN, assert_matches, losses

from speedllm.config import compose_config

pytestmark = pytest.mark.distributed

MOE = ["model=qwen3_moe_tiny", "model.hidden_size=64", "model.moe_intermediate_size=32", "model.intermediate_size=64",
       "model.num_hidden_layers=4", "model.mlp_only_layers=[0]", "model.head_dim=16",
       "model.router_aux_loss_coef=1.0"]
LAYOUTS = {  # name: (world size, parallel overrides)
    "pp2_ep2": (4, ["parallel=pp2", "parallel.dp=2", "parallel.ep=2"]),
    "pp2": (2, ["parallel=pp2", "parallel.pp_layers=[1,3]"]),
    "pp2_vpp2": (2, ["parallel=pp2_vpp2"]),
    "pp2_zbv": (2, ["parallel=pp2_vpp2", "parallel.pp_schedule=ZBVZeroBubble"]),
}
RESUMED = {"fsdp2": ["parallel=fsdp2"], "single": ["parallel=single"]}


def config(run_dir: Path, overrides):
    cfg = compose_config(*MOE, *RUN, *overrides, f"run_dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints")
    OmegaConf.resolve(cfg)
    return cfg


def runtime(cfg, rank: int, world_size: int):
    from speedllm.parallel.mesh import build_mesh
    from speedllm.runtime import Runtime

    mesh = build_mesh(cfg.parallel, "cpu") if world_size > 1 else None
    return Runtime(rank=rank, world_size=world_size, local_rank=rank, mesh=mesh, ep=cfg.parallel.ep)


def train(run_dir: Path, overrides, rank=0, world_size=1) -> None:
    """The task as a launched rank runs it (speedllm.launcher.run_task), on this process' group."""
    from speedllm.launcher import run_task

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = config(run_dir, overrides)
    run_task(cfg, runtime(cfg, rank, world_size))


def evaluate_initial(path: Path, overrides, rank=0, world_size=1) -> None:
    """(ce_sum, aux) of the initial model on the first training batch, through ParallelModel's call."""
    from speedllm.config.schema import typed
    from speedllm.data.loader import build_loader
    from speedllm.runtime import seed_everything
    from speedllm.train.build import build_model
    from speedllm.train.step import model_inputs

    cfg = typed(config(path.parent, overrides))
    seed_everything(cfg.seed)
    pm = build_model(cfg, runtime(cfg, rank, world_size))
    batch = next(iter(build_loader(cfg, "train", 0, 1, cfg.train.micro_batch_size, cfg.train.seq_len, cfg.seed)))
    with torch.no_grad():
        ce_sum, aux = pm(batch["tokens"], **model_inputs(batch))
    if rank == 0:
        torch.save(torch.stack([ce_sum, aux]), path)


def _rank(rank: int, world_size: int, port: int, root: Path, jobs) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    for name, overrides in jobs:
        if name in LAYOUTS:
            evaluate_initial(root / f"{name}_eval.pt", overrides, rank, world_size)
        train(root / name, overrides, rank, world_size)
    dist.barrier()
    dist.destroy_process_group()


def spawn(world_size: int, root: Path, jobs) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world_size, port, root, jobs), nprocs=world_size)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run directories: the single-process reference (6 steps), every layout (5 steps), the resumed runs."""
    root = tmp_path_factory.mktemp("moe_pp")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks; restored below, or later tests in this worker inherit it
    evaluate_initial(root / "single_eval.pt", ["parallel=single"])
    train(root / "single", ["parallel=single", "checkpoint.every=5"])
    stop = ["train.stop_after=5"]
    spawn(4, root, [(name, [*overrides, *stop]) for name, (world, overrides) in LAYOUTS.items() if world == 4])
    checkpoint = f"checkpoint.load={root / 'pp2_ep2' / 'checkpoints' / 'step_00000005'}"
    spawn(2, root, [*[(name, [*overrides, *stop]) for name, (world, overrides) in LAYOUTS.items() if world == 2],
                    ("resumed_fsdp2", [*RESUMED["fsdp2"], checkpoint])])
    train(root / "resumed_single", [*RESUMED["single"], checkpoint])
    torch.set_num_threads(threads)
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_pipeline_layout_matches_single_process(layout, runs):
    assert_matches(runs / layout, runs / "single")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_pipeline_evaluation_matches_single_process(layout, runs):
    ce_sum, aux = torch.load(runs / f"{layout}_eval.pt")
    ref_ce, ref_aux = torch.load(runs / "single_eval.pt")
    assert aux > 0
    assert abs(ce_sum - ref_ce) <= 1e-5 * ref_ce and abs(aux - ref_aux) <= 1e-6 * ref_aux, (ce_sum, aux, ref_ce,
                                                                                           ref_aux)


@pytest.mark.parametrize("resumed", list(RESUMED))
def test_pp2_ep2_checkpoint_resumes_under_fsdp2_and_single_process(resumed, runs):
    (loss,) = losses(runs / f"resumed_{resumed}")  # step 6 only
    expected = losses(runs / "single")[5]
    assert abs(loss - expected) <= 1e-5 * expected
