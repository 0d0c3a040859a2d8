"""task=dryrun: ranks of a large job built on torch's fake process group with the model on the meta device.

What each built rank holds (the real torch placements after parallelize) must equal the planner's exact bytes
(speedllm.planner.memory, computed from shapes and placement rules, not from the built modules)."""

import pytest
import torch.distributed as dist

from speedllm.config import compose_config
from speedllm.config.schema import typed
from speedllm.parallel.rules import layout_errors
from speedllm.tasks.dryrun import build_rank, sample_ranks

pytestmark = pytest.mark.unit


@pytest.fixture
def config():
    """`config(*overrides, world=N)`: the typed run of a task=dryrun command on N ranks (dp inferred)."""

    def make(*overrides, world):
        cfg = compose_config("task=dryrun", "hardware=cpu", "hardware.dtype=float32", *overrides)
        p = cfg.parallel
        p.dp = world // (p.tp * p.pp * p.cp)
        cfg.launcher.nproc_per_node = world
        cfg.run_dir = "unused"
        return typed(cfg)

    yield make
    if dist.is_initialized():  # build_rank leaves the fake group of its last rank
        dist.destroy_process_group()


def test_moe_fsdp_ep_at_32_ranks_holds_the_planned_bytes(config):
    cfg = config("model=qwen3_moe_tiny", "parallel=ep2", "parallel.ep=8", world=32)
    assert sample_ranks(cfg.parallel, 32) == [0, 31]  # one pipeline stage: its first and last rank
    reports = [build_rank(cfg, rank, 32) for rank in (0, 7, 31)]  # first and last expert of the first ep group
    experts = [r.experts for r in reports]
    assert experts == [(0, 1), (7, 8), (7, 8)] and {r.expert_shards for r in reports} == {4}
    for r in reports[:2]:
        assert (r.params, r.grads, r.optimizer) == r.planned, r.rank
    for r in reports:
        assert r.layers == [0, 1, 2, 3] and r.moe_layers == 4 and r.embed and r.head
    # The planner costs the first rank of each axis. Every other piece splits evenly over 32 ranks (and each
    # rank's one expert is sharded over its 4 edp ranks by rows), but the router's 8 rows do not: torch.chunk
    # gives ranks 8-31 none of them, so rank 31 holds one row per MoE layer less than rank 0.
    m, last = cfg.model, reports[2]
    row = m.num_hidden_layers * m.hidden_size * 4
    assert (last.params, last.grads, last.optimizer) == (r.planned[0] - row, r.planned[1] - row, r.planned[2] - 2 * row)


def test_dense_tp_pp_vpp_ranks_hold_the_planned_bytes(config):
    cfg = config("model=qwen3_tiny", "parallel=tp2_pp2", "parallel.vpp=2", "parallel.pp_schedule=Interleaved1F1B",
                 world=16)
    first, last = build_rank(cfg, 0, 16), build_rank(cfg, 15, 16)
    assert first.stages == [0, 2] and last.stages == [1, 3]
    assert first.embed and not first.head and last.head and not last.embed
    assert first.coords["tp"] == (0, 2) and last.coords == {"pp": (1, 2), "dp": (3, 4), "cp": (0, 1), "tp": (1, 2)}
    for r in (first, last):
        assert (r.params, r.grads, r.optimizer) == r.planned, r.rank


@pytest.mark.parametrize("parallel", [["parallel=pp2_vpp2", "parallel.ep=2"], ["parallel=tp2", "parallel.ep=2"]])
def test_moe_under_pipeline_and_tensor_parallel_holds_the_planned_bytes(config, parallel):
    """MoE x PP and MoE x TP: every sampled rank's experts, router and stages as the planner costs them. The
    planner follows the MoE x TP placement of branch h/b (experts over ep x edp carved out of dp x cp x tp);
    until that is built, validation refuses MoE x TP and this case waits for it."""
    cfg = config("model=qwen3_moe_tiny", *parallel, world=8)
    p = cfg.parallel
    if p.tp > 1 and layout_errors(cfg.model, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, cp=p.cp, dp=p.dp,
                                  schedule=p.pp_schedule):
        pytest.skip("MoE x TP is not built on this branch yet (validation refuses it)")
    for rank in sample_ranks(cfg.parallel, 8):
        r = build_rank(cfg, rank, 8)
        assert (r.params, r.grads, r.optimizer) == r.planned, rank
        assert r.moe_layers == len(r.layers) == 4 // cfg.parallel.pp
        assert r.experts == (4 * r.coords["ep"][0], 4 * r.coords["ep"][0] + 4)


def test_dryrun_command_prints_one_line_per_rank(launch, tmp_path):
    code, out, err = launch(tmp_path / "run", "task=dryrun", "model=qwen3_moe_tiny", "parallel=ep2", "parallel.ep=4",
                            "parallel.dp=-1", "hardware=cpu", "hardware.dtype=float32", "launcher.nproc_per_node=32", "dryrun.ranks=[3,7]",
                            "optim=sgd")
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert [line.split()[1] for line in lines] == ["3", "7"]
    assert all(line.endswith("= task=plan's exact bytes") for line in lines), out
    code, _, err = launch(tmp_path / "bad", "task=dryrun", "model=qwen3_moe_tiny", "parallel=ep2", "parallel.dp=-1",
                          "hardware=cpu", "hardware.dtype=float32", "launcher.nproc_per_node=32", "dryrun.ranks=[32]")
    assert code == 2 and "dryrun.ranks: rank 32 is not in the 32-rank job" in err


@pytest.mark.parametrize("offload", ["params", "optimizer"])
def test_offload_ranks_hold_the_planned_bytes_on_device_and_host(config, offload):
    """parallel.offload moves what FSDP2 shards (all of it, or the optimizer states) to the host: the dry run
    prints the rank's bytes on each side, equal to the planner's."""
    from speedllm.tasks.dryrun import line

    cfg = config("model=qwen3_tiny", "parallel=fsdp2", f"parallel.offload={offload}", world=2)
    r = build_rank(cfg, 1, 2)
    text = line(r)
    assert (r.params, r.grads, r.optimizer) == r.planned
    assert text.endswith("= task=plan's exact bytes")
    device = "params 0.000 MiB grads 0.000 MiB" if offload == "params" else "optimizer 0.000 MiB | host: params 0.000 MiB"
    assert device in text


@pytest.mark.parametrize("parallel,world", [("fsdp2", 4), ("tp2", 2)])
def test_distill_teacher_is_counted_as_built(parallel, world, config, hf_dir):
    """distill.teacher (a transformers-saved model): each rank holds its shard of the teacher's fp32 weights (1/4
    under fsdp over 4 ranks, its tensor-parallel rows under tp2), and the planner's teacher bytes say the same."""
    path, hf, _ = hf_dir
    cfg = config(f"parallel={parallel}", f"distill.teacher={path}", world=world)
    whole = sum(p.numel() for name, p in hf.named_parameters()) * 4  # tied: the embedding counted once
    for rank in range(world):
        held, planned = build_rank(cfg, rank, world).teacher
        assert held == planned
        if parallel == "fsdp2":
            assert held == pytest.approx(whole / world, rel=0.01)  # FSDP2 pads uneven dim-0 shards
        else:
            assert whole / 2 < held < whole  # norms (and the tied table's rows) are whole on every rank


def test_hybrid_pipeline_ranks_hold_the_split_the_planner_costs(config):
    """A hybrid model whose attention layers come last, at 4096 tokens: the run's stage split (built by
    parallelize, as training builds it) is the planner's split by cost, not by count, and each pipeline rank
    holds the planner's exact bytes."""
    from speedllm.parallel.pipeline import stage_layers

    kinds = ["linear_attention"] * 6 + ["full_attention"] * 2
    cfg = config("model=qwen3_5_tiny", "model.num_hidden_layers=8", "model.layer_types=[" + ",".join(kinds) + "]",
                 "train.seq_len=4096", "parallel=pp2", world=2)
    split = stage_layers(cfg.model, 2, 4096)
    assert split == [6, 2]  # an attention layer costs about three Gated DeltaNet layers at this length
    for rank, layers in ((0, range(0, 6)), (1, range(6, 8))):
        r = build_rank(cfg, rank, 2)
        assert r.layers == list(layers)
        assert (r.params, r.grads, r.optimizer) == r.planned, rank


@pytest.mark.parametrize("model", ["qwen3_5_397b_a17b", "qwen3_next_80b_a3b"])
def test_published_hybrid_models_on_their_planned_256_h100_layout_hold_the_planned_bytes(model):
    """task=dryrun parallel=auto on h100 x 256 (4096 tokens, 1024 sequences a step) builds task=plan's first
    layout from the published config; every sampled rank (first and last stage, first and last expert group)
    holds within 10% of the plan's bytes for its pipeline rank, the first rank of a stage exactly."""
    from omegaconf import OmegaConf

    from speedllm.config.resolve import choose_layout
    from speedllm.config.schema import typed
    from speedllm.planner.layout import layout_from_config
    from speedllm.planner.search import Planner, problem_from_config
    from speedllm.tasks.dryrun import line

    cfg = compose_config("task=dryrun", "parallel=auto", f"model={model}", "hardware=h100", "launcher.nnodes=32",
                         "launcher.nproc_per_node=8", "train.seq_len=4096", "train.global_batch_size=1024",
                         "run_dir=unused")
    OmegaConf.set_struct(cfg, False)
    planner = Planner(problem_from_config(cfg, 256))
    choose_layout(cfg)  # the plan's first row (tests/test_plan_rules.py)
    cfg = typed(cfg)
    layout = layout_from_config(cfg.parallel, cfg.train)
    assert layout.pp > 1 and layout.ep > 1
    memories = planner.rank_memories(layout, cfg.parallel.pp_layers)
    try:
        for rank in sample_ranks(cfg.parallel, 256):
            r = build_rank(cfg, rank, 256)
            mem = memories[r.coords["pp"][0]]
            for built, planned in zip((r.params, r.grads, r.optimizer), (mem.params, mem.grads, mem.optimizer)):
                assert abs(built - planned) <= 0.1 * planned, (rank, line(r))
            if rank % (256 // cfg.parallel.pp) == 0:
                assert line(r).endswith("= task=plan's exact bytes")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
