"""Every pipeline rule torch.distributed.pipelining enforces at a run's first step is refused before launch.

Walks a grid of schedules, pipeline sizes and micro-batch counts: torch's own schedule classes (built over the
fake process group, as a real run would build them) raise exactly where speedllm.parallel.rules refuses, and
the launcher refuses such a config with the one-line message (exit 2) instead of starting ranks that die.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from speedllm.parallel.rules import pipeline_batch_errors

pytestmark = pytest.mark.unit

SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2,
             "DualPipeV": 2}  # schedule: stages per pipeline rank


def torch_refuses(schedule: str, pp: int, vpp: int, n: int, rows: int) -> bool:
    """Whether torch's schedule (rank 0 of `pp`, n micro-batches) or its micro-batch split of `rows` raises."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    stages = pp * vpp
    indices = [0] if vpp == 1 else [0, stages - 1] if schedule in ("ZBVZeroBubble", "DualPipeV") else [0, pp]
    modules = [PipelineStage(nn.Linear(2, 2), i, stages, torch.device("cpu")) for i in indices]
    schedule_class = get_schedule_class(schedule)
    try:
        schedule_class(modules[0] if issubclass(schedule_class, PipelineScheduleSingle) else modules, n,
                       loss_fn=lambda out, target: out.sum())
        chunks, _ = split_args_kwargs_into_chunks((torch.zeros(rows, 2),), {}, n)
    except (ValueError, AssertionError):
        return True
    return len(chunks) != n  # the schedule's step() then raises "Expecting n args but got ..."


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(size):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)

    yield init
    dist.destroy_process_group()


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_rules_refuse_exactly_what_torch_refuses(schedule, pp, fake_world):
    fake_world(pp)
    vpp = SCHEDULES[schedule]
    refused = 0
    for global_batch, micro_batch, dp, pp_microbatches in [(g, m, d, n) for g in (1, 2, 3, 4, 6, 8, 12) for m in (1, 2)
                                                           for d in (1, 2) for n in (0, 1, 3, 5, 8)
                                                           if g % (m * d) == 0]:
        n = pp_microbatches or global_batch // (micro_batch * dp)
        ours = pipeline_batch_errors(pp=pp, vpp=vpp, schedule=schedule, pp_microbatches=pp_microbatches,
                                     global_batch=global_batch, micro_batch=micro_batch, dp=dp)
        assert bool(ours) == torch_refuses(schedule, pp, vpp, n, global_batch // dp), \
            (global_batch, micro_batch, dp, pp_microbatches, ours)
        refused += bool(ours)
    assert refused  # the grid reaches the rules


def test_launcher_refuses_too_few_microbatches_before_starting_ranks(launch, tmp_path):
    """The reported case: 4 ranks used to start and each die in torch's 1F1B constructor."""
    code, out, err = launch(tmp_path / "run", "model=qwen3_moe_tiny", "parallel=pp2", "parallel.dp=2",
                            "parallel.ep=2", "train.micro_batch_size=2", "train.global_batch_size=4")
    assert code == 2 and out == ""
    assert err.strip() == (
        "error: parallel.pp_schedule=1F1B over 2 stages needs at least 2 micro-batches per step, but "
        "train.global_batch_size=4 / (train.micro_batch_size=2 x parallel.dp=2) gives 1; raise "
        "train.global_batch_size to 8, lower train.micro_batch_size, or set parallel.pp_microbatches=2 (or use "
        "pp_schedule=GPipe)")
