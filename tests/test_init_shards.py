"""Per-shard initialization: every layout's ranks fill their shards with exactly the single-process init.

`normal_block_` is checked block by block against the whole tensor drawn at once; then one spawned 4-rank job
builds the model under several layouts (FSDP2 with uneven shards, TP, FSDP2 x TP, EP, pipeline stages) through
the training code path and compares every parameter, gathered by DTensor, bit for bit with `Qwen3.init_weights`.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from speedllm.models.init import CHUNK_NUMEL, chunk_rows, normal_block_

pytestmark = pytest.mark.distributed

DENSE = ["model=qwen3_tiny", "model.hidden_size=64", "model.intermediate_size=96", "model.num_hidden_layers=4",
         "model.head_dim=16", f"model.vocab_size={CHUNK_NUMEL // 64 + 4099}"]  # an embedding of two chunks
MOE = ["model=qwen3_moe_tiny", "model.hidden_size=64", "model.moe_intermediate_size=32", "model.num_hidden_layers=2",
       "model.head_dim=16"]
HYBRID = ["model=qwen3_5_moe_tiny", "model.hidden_size=64", "model.num_hidden_layers=4"]  # A_log: 1 row per rank
LAYOUTS = {  # name: (model, parallel overrides), 4 ranks each
    "fsdp4": (DENSE, ["parallel.dp=4"]),
    "fsdp2_tp2": (DENSE, ["parallel=fsdp2_tp2"]),
    "tp2_pp2": (DENSE, ["parallel=tp2_pp2"]),
    "pp2_vpp2_dp2": (DENSE, ["parallel=pp2_vpp2", "parallel.dp=2"]),
    "fsdp4_ep2": (MOE, ["parallel.dp=4", "parallel.ep=2"]),
    "fsdp2_tp2_moe": (MOE, ["parallel=fsdp2_tp2"]),
    "fsdp4_hybrid": (HYBRID, ["parallel.dp=4"]),
}


def test_any_block_equals_that_block_of_the_whole_tensor():
    shape = (7, CHUNK_NUMEL // 3 + 1)  # 2 rows per chunk, the last chunk shorter
    assert chunk_rows(shape) == 2
    whole = torch.empty(shape)
    normal_block_(whole, "w", shape, (0, 0), 0.02, seed=5)
    blocks = [((0, 7), (0, 5)), ((1, 4), (3, 9)), ((5, 7), (shape[1] - 4, shape[1])), ((3, 3), (0, 1)),
              ((1, 5), (0, shape[1]))]  # whole rows: chunk 1 drawn in place, chunks 0 and 2 in part
    for rows, cols in blocks:
        block = torch.empty(rows[1] - rows[0], cols[1] - cols[0])
        normal_block_(block, "w", shape, (rows[0], cols[0]), 0.02, seed=5)
        assert torch.equal(block, whole[rows[0]:rows[1], cols[0]:cols[1]])
    assert abs(whole.mean().item()) < 1e-4 and abs(whole.std().item() - 0.02) < 1e-4
    other = torch.empty(shape)
    normal_block_(other, "v", shape, (0, 0), 0.02, seed=5)  # another name or seed: other values
    assert not torch.equal(other, whole)


def _model(overrides, world_size, rank=0):
    """This rank's ParallelModel, built as the training loop builds it (speedllm.train.build.build_model)."""
    from speedllm.config import compose_config
    from speedllm.parallel.mesh import build_mesh
    from speedllm.runtime import Runtime
    from speedllm.train.build import build_model

    cfg = compose_config("hardware=cpu", "hardware.dtype=float32", "seed=11", *overrides)
    mesh = build_mesh(cfg.parallel, "cpu") if world_size > 1 else None
    return build_model(cfg, Runtime(rank=rank, world_size=world_size, mesh=mesh, ep=cfg.parallel.ep))


def _rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    for layout, (model, parallel) in LAYOUTS.items():
        expected = _model([*model, "parallel=single"], 1).module.state_dict()
        pm = _model([*model, *parallel], world_size, rank)
        mismatched = []
        for part in pm.parts:
            for name, param in part.named_parameters():
                name = name.replace("_checkpoint_wrapped_module.", "")
                full = param.full_tensor() if isinstance(param, DTensor) else param
                if not torch.equal(full, expected[name]):
                    mismatched.append(name)
        torch.save(mismatched, os.path.join(out_dir, f"{layout}_rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def mismatches(tmp_path_factory):
    out = tmp_path_factory.mktemp("init")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(4, port, str(out)), nprocs=4)
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_starts_from_the_single_process_weights(layout, mismatches):
    for rank in range(4):
        assert torch.load(mismatches / f"{layout}_rank{rank}.pt") == [], rank
