"""The planner against what multi-rank CPU runs actually hold and allocate (gloo, the tiny models).

Each layout runs the real training code path (speedllm.train.build.build_model and train_step) on 2 spawned ranks
(speedllm.planner.measure.measure_layouts: every layout in turn on one set of ranks). Measured per rank: the
parameter elements it stores (local shards), the bytes of its weights, of the gradients the update sees and of the
AdamW states, and the peak bytes of live tensor storage during a step (PeakTensorMemory: every allocation an op
makes, FSDP2's storage resizes, minus frees — the CPU analogue of torch.cuda.max_memory_allocated). The planner's
numbers must equal the first four exactly and the peak within 15%.
"""

import pytest

from speedllm.config import compose_config
from speedllm.planner.layout import layout_from_config
from speedllm.planner.measure import measure_layouts
from speedllm.planner.memory import rank_params
from speedllm.planner.search import Planner, problem_from_config

pytestmark = pytest.mark.distributed

COMMON = ["hardware=cpu", "hardware.dtype=float32", "train.seq_len=128", "train.micro_batch_size=2", "train.global_batch_size=4",
          "train.loss_chunk_size=256"]


def predicted(overrides, world):
    """(parameter elements per pipeline rank, Memory per pipeline rank) from the planner."""
    cfg = compose_config(*overrides)
    cfg.parallel.dp = world // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    planner = Planner(problem_from_config(cfg, world))
    layout = layout_from_config(cfg.parallel, cfg.train)
    split = planner.split(layout, cfg.parallel.pp_layers)
    held = [rank_params(planner.mt, layout, split, r, planner.state_numel).sharded for r in range(layout.pp)]
    return held, planner.rank_memories(layout, cfg.parallel.pp_layers)


CASES = [("qwen3_tiny", "fsdp2", "adamw"), ("qwen3_moe_tiny", "fsdp2", "adamw"), ("qwen3_tiny", "tp2", "adamw"),
         ("qwen3_tiny", "pp2", "adamw"), ("qwen3_tiny", "tp2", "sgd")]


def overrides_of(model, parallel, optim):
    # SGD with momentum keeps one buffer per parameter (Adafactor runs single-process: tests/test_planner.py)
    extra = ["optim.momentum=0.9"] if optim == "sgd" else []
    return [f"model={model}", f"parallel={parallel}", f"optim={optim}", *extra, *COMMON]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{case: per-rank records}, every case measured on one set of 2 ranks."""
    root = tmp_path_factory.mktemp("measured")
    out_dirs = [root / "_".join(case) for case in CASES]
    for out in out_dirs:
        out.mkdir()
    records = measure_layouts([compose_config(*overrides_of(*case)) for case in CASES], 2, out_dirs)
    return dict(zip(CASES, records))


@pytest.mark.parametrize("model,parallel,optim", CASES)
def test_planner_matches_sharded_runs(model, parallel, optim, measured):
    held, memories = predicted(overrides_of(model, parallel, optim), 2)
    for rec in measured[model, parallel, optim]:
        mem = memories[rec["pp_rank"]]
        assert rec["held"] == held[rec["pp_rank"]], rec
        assert (rec["param_bytes"], rec["grad_bytes"], rec["optimizer_bytes"]) == (mem.params, mem.grads, mem.optimizer)
        if optim == "adamw":  # the update's temporaries are modelled for foreach AdamW
            assert 0.85 <= mem.total / rec["peak"] <= 1.15, (rec, mem)
