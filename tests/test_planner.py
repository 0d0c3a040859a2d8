"""The planner: exact parameter counts, predicted vs measured peak memory in one process, MindSpeed's published
Qwen3 layouts, `parallel=auto` and `task=plan` end to end (multi-rank checks: test_planner_dist.py)."""

import random
import time
from itertools import combinations

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.config import compose_config
from speedllm.config.resolve import choose_layout
from speedllm.config.validate import validate
from speedllm.hardware import load_profile
from speedllm.models.flops import flops_per_token, layer_flops
from speedllm.parallel.pipeline import balanced_split, stage_layers
from speedllm.planner.layout import Layout, layout_from_config
from speedllm.planner.measure import measure_training_step
from speedllm.planner.memory import rank_params
from speedllm.planner.mindspeed import PUBLISHED, published_estimate, published_layout
from speedllm.planner.search import Planner, Problem, problem_from_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny", "qwen3_8b"])
def test_single_rank_parameter_count_is_the_models(name):
    from speedllm.models.qwen3 import Qwen3, num_params

    cfg = compose_config(f"model={name}").model
    with torch.device("meta"):
        expected = num_params(Qwen3(cfg))
    planner = Planner(Problem(cfg, load_profile("cpu"), 1, 128, 1))
    layout = Layout()
    assert rank_params(planner.mt, layout, planner.split(layout), 0).sharded == expected


def test_stage_split_is_even_with_larger_middle_stages():
    assert balanced_split((1.0,) * 94, 4) == (23, 24, 24, 23)
    assert balanced_split((1.0,) * 96, 32) == (3,) * 32
    assert sum(balanced_split((1.0,) * 94, 32)) == 94 and max(balanced_split((1.0,) * 94, 32)) - min(
        balanced_split((1.0,) * 94, 32)) == 1


def test_stage_split_by_cost_is_the_best_contiguous_split():
    """Layers of two costs: the costliest stage of the split is the cheapest any contiguous split allows, and of
    those splits its stage costs are the most even (every split enumerated)."""
    rng = random.Random(0)
    for _ in range(30):
        costs = tuple(rng.choice((1.0, 1.0, 1.0, 5.5)) for _ in range(rng.randint(5, 12)))
        stages = rng.randint(2, 4)

        def score(sizes):
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            sums = [sum(costs[a:a + n]) for a, n in zip(starts, sizes)]
            return max(sums), sum(x * x for x in sums)

        splits = [tuple(b - a for a, b in zip((0, *cuts), (*cuts, len(costs))))
                  for cuts in combinations(range(1, len(costs)), stages - 1)]
        assert score(balanced_split(costs, stages)) == min(map(score, splits)), (costs, stages)


def test_hybrid_stage_split_costs_each_layer_kind():
    """Qwen3.5-27B with its 16 attention layers last, at 32k tokens (attention's scores grow with the length, a
    Gated DeltaNet layer's rule does not): the split by cost gives the attention stage fewer layers, and its
    costliest stage is far cheaper than the split by count's; the planner costs each stage's own layers, and the
    step at the pace of the costliest stage."""
    layers = ["linear_attention"] * 48 + ["full_attention"] * 16
    cfg = compose_config("model=qwen3_5_27b", "model.layer_types=[" + ",".join(layers) + "]", "hardware=h100",
                         "train.seq_len=32768", "train.global_batch_size=64")
    m, seq = cfg.model, 32768
    costs = layer_flops(m, seq)
    assert costs[-1] > 1.4 * costs[0]
    assert sum(costs) + 6 * m.vocab_size * m.hidden_size == pytest.approx(flops_per_token(m, seq), rel=1e-12)

    def largest(sizes):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return max(sum(costs[a:a + n]) for a, n in zip(starts, sizes))

    split = stage_layers(m, 4, seq)
    assert sum(split) == 64 and split[0] > 16 > split[-1]
    assert largest(split) < 0.8 * largest([16] * 4)  # 0.757
    planner = Planner(problem_from_config(cfg, 8))
    layout = Layout(pp=4, dp=2, recompute="full")
    assert planner.split(layout) == split
    ranks = planner.rank_params(layout, split)
    assert ranks[0].layer_mix == {(True, False): split[0]} and ranks[-1].layer_mix == {(False, False): split[-1]}
    # the pipeline computes at its busiest rank's pace: the split by count is costed that much slower
    by_cost, by_count = planner.estimate(layout).time, planner.estimate(layout, [16] * 4).time
    assert by_count.compute / by_cost.compute == pytest.approx(largest([16] * 4) / largest(split), rel=1e-9)


@pytest.mark.parametrize("overrides", [
    ["train.micro_batch_size=2", "train.global_batch_size=2"],
    ["train.micro_batch_size=2", "train.global_batch_size=4", "train.recompute=full"],
    ["train.micro_batch_size=2", "train.global_batch_size=2", "train.recompute=selective"],
])
def test_predicted_peak_within_15_percent_of_measured_single_process(overrides, tmp_path):
    """The second of two real training steps (the loop's build_model / train_step): peak live tensor bytes."""
    from speedllm.runtime import Runtime

    cfg = compose_config("hardware=cpu", "hardware.dtype=float32", "parallel=single", "train.seq_len=128", *overrides)
    cfg.run_dir = str(tmp_path)
    torch.manual_seed(0)
    measured = measure_training_step(cfg, Runtime())
    planner = Planner(problem_from_config(cfg, 1))
    memory = planner.estimate(layout_from_config(cfg.parallel, cfg.train)).memory
    assert (measured["param_bytes"], measured["grad_bytes"], measured["optimizer_bytes"]) == (
        memory.params, memory.grads, memory.optimizer)
    assert 0.85 <= memory.total / measured["peak"] <= 1.15, (memory, measured)


@pytest.mark.parametrize("optim", [["optim=sgd"], ["optim=sgd", "optim.momentum=0.9"], ["optim=adafactor"]])
def test_planned_optimizer_bytes_are_the_optimizers_own(optim, tmp_path):
    """SGD keeps nothing (or one momentum buffer), Adafactor rows + columns per matrix: as torch allocates them."""
    from speedllm.runtime import Runtime

    cfg = compose_config("hardware=cpu", "hardware.dtype=float32", "parallel=single", "train.seq_len=32", "train.micro_batch_size=2",
                         "train.global_batch_size=2", *optim)
    cfg.run_dir = str(tmp_path)
    measured = measure_training_step(cfg, Runtime())
    memory = Planner(problem_from_config(cfg, 1)).estimate(layout_from_config(cfg.parallel, cfg.train)).memory
    assert (measured["param_bytes"], measured["grad_bytes"], measured["optimizer_bytes"]) == (
        memory.params, memory.grads, memory.optimizer)
    assert (memory.optimizer == 0) == (optim == ["optim=sgd"])


@pytest.mark.parametrize("name,world,hw_name,degrees,micro,global_batch,recompute", PUBLISHED)
def test_mindspeed_layouts_fit_and_ours_is_at_least_as_fast(name, world, hw_name, degrees, micro, global_batch,
                                                            recompute):
    planner = Planner(Problem(compose_config(f"model={name}").model, load_profile(hw_name), world, 4096, global_batch))
    theirs = published_estimate(planner, world, degrees, micro, recompute)
    # MindSpeed's MoE layouts use pipeline stages, which parallelize does not build for MoE models yet
    assert planner.invalid_reason(published_layout(world, degrees, micro)) in (
        None, f"parallel.pp={degrees['pp']} with MoE model {name} is not supported (the load-balancing loss spans "
              "all layers); use parallel.pp=1 and parallel.ep for the experts")
    assert theirs.fits, theirs.reason
    start = time.perf_counter()
    best = planner.search().best
    assert time.perf_counter() - start < 30
    assert best.fits and best.tokens_per_s >= theirs.tokens_per_s


def test_parallel_auto_fills_a_valid_layout():
    cfg = compose_config("model=qwen3_8b", "hardware=npu_a2", "parallel=auto", "launcher.nproc_per_node=8",
                         "train.seq_len=4096", "train.global_batch_size=64")
    OmegaConf.set_struct(cfg, False)
    choose_layout(cfg)
    p = cfg.parallel
    assert p.dp * p.tp * p.pp * p.cp == 8
    cfg.task = compose_config("task=plan").task  # the layout rules only: no device or data checks on this machine
    validate(cfg, 8, 8)
    planner = Planner(problem_from_config(cfg, 8))
    chosen = planner.estimate(layout_from_config(p, cfg.train), p.pp_layers)
    assert chosen.fits and chosen.tokens_per_s == planner.search().best.tokens_per_s


def test_task_plan_for_235b_on_256_npus_prints_its_table_in_under_a_minute(tmp_path, launch):
    start = time.perf_counter()
    code, out, err = launch(tmp_path, "task=plan", "model=qwen3_235b_a22b", "hardware=npu_a2", "launcher.nnodes=16",
                            "launcher.nproc_per_node=16", "train.seq_len=4096", "train.global_batch_size=1024",
                            timeout=120)
    elapsed = time.perf_counter() - start
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("plan: qwen3_235b_a22b on 256 x npu_a2")
    assert any(line.split()[:1] == ["1"] for line in lines)  # the first row of the ranked table
    assert "rejected" in out
    assert elapsed < 60


def test_plan_says_why_a_user_layout_does_not_fit(tmp_path, launch):
    code, out, err = launch(tmp_path, "task=plan", "model=qwen3_32b", "hardware=npu_a2", "parallel=tp8",
                            "launcher.nproc_per_node=8", "train.seq_len=4096", "train.global_batch_size=64",
                            "train.micro_batch_size=8", timeout=120)
    assert code == 0, err
    assert "your layout (parallel=tp8)" in out
    assert "rejected: needs" in out


def test_parallel_auto_for_generation_splits_only_what_does_not_fit():
    cfg = compose_config("model=qwen3_32b", "hardware=npu_a2", "parallel=auto", "task=generate",
                         "launcher.nproc_per_node=2")
    OmegaConf.set_struct(cfg, False)
    choose_layout(cfg)  # 32.8B bf16 weights (61 GiB) do not fit one 64 GiB NPU, half of them do
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp) == (2, 1, 1)


QWEN3_8B_ON_ONE_H100 = ["model=qwen3_8b", "hardware=h100", "launcher.nproc_per_node=1", "train.seq_len=4096",
                        "train.global_batch_size=8"]


def overrides_of(short: str) -> list:
    """The command-line overrides of a Layout.short() name (as task=plan prints it), e.g. `tp1 pp1 dp1 mb8 full
    offload-optimizer act-offload`."""
    out = ["train.activation_offload=false"]
    for part in short.split():
        for prefix, key in (("tp", "parallel.tp"), ("pp", "parallel.pp"), ("vpp", "parallel.vpp"),
                            ("dp", "parallel.dp"), ("ep", "parallel.ep"), ("mb", "train.micro_batch_size")):
            if part.startswith(prefix) and part[len(prefix):].isdigit():
                out.append(f"{key}={part[len(prefix):]}")
        if part in ("none", "selective", "full"):
            out.append(f"train.recompute={part}")
        if part.startswith("offload-"):
            out.append(f"parallel.offload={part[len('offload-'):]}")
        if part == "act-offload":
            out[0] = "train.activation_offload=true"
    return out


def test_plan_offloads_qwen3_8b_on_one_h100_with_the_dry_runs_device_bytes(tmp_path, launch):
    """Full training of an 8B model needs ~16 bytes a parameter (fp32 weights, gradients, two AdamW moments):
    ~122 GiB before activations, more than an 80 GB H100. The plan offloads, and the dry run of its choice holds
    the bytes it printed, on the device and on the host."""
    code, out, err = launch(tmp_path / "plan", "task=plan", *QWEN3_8B_ON_ONE_H100, timeout=180)
    assert code == 0, err
    lines = out.splitlines()
    first = next(line for line in lines if line.split()[:1] == ["1"])
    layout = first[5:53].strip()
    assert "offload-" in layout or "act-offload" in layout, first
    planned = next(line for line in lines if line.startswith("#1 on pp rank 0: ")).split(": ", 1)[1]
    code, out, err = launch(tmp_path / "dryrun", "task=dryrun", *QWEN3_8B_ON_ONE_H100, *overrides_of(layout),
                            timeout=180)
    assert code == 0, err
    rank0 = next(line for line in out.splitlines() if line.startswith("rank 0 "))
    assert f"| {planned} | = task=plan's exact bytes" in rank0, (planned, rank0)


def test_without_offload_nothing_fits_qwen3_8b_on_one_h100(tmp_path, launch):
    code, out, err = launch(tmp_path, "task=plan", *QWEN3_8B_ON_ONE_H100, "plan.allow_offload=false", timeout=180)
    assert code == 0, err
    assert "0 fit" in out.splitlines()[0]
    assert "no layout fits (offload was not considered (plan.allow_offload=false))" in out
    cfg = compose_config(*QWEN3_8B_ON_ONE_H100, "parallel=auto", "plan.allow_offload=false")
    OmegaConf.set_struct(cfg, False)
    with pytest.raises(Exception, match="or allow offload \\(plan.allow_offload=true\\)"):
        choose_layout(cfg)


def test_offload_moves_device_bytes_to_the_host_and_charges_the_copies():
    """The memory model moves exactly the offloaded components to the host; the time model charges the optimizer
    states' round trip at the host link and the host's update of offloaded parameters."""
    from dataclasses import replace

    problem = problem_from_config(compose_config(*QWEN3_8B_ON_ONE_H100), 1)
    planner = Planner(problem)
    base = Layout(micro_batch=8, recompute="full")
    plain = planner.estimate(base).memory
    params = planner.estimate(replace(base, offload="params"))
    optimizer = planner.estimate(replace(base, offload="optimizer"))
    activations = planner.estimate(replace(base, offload="optimizer", activation_offload=True))
    assert (params.memory.params, params.memory.grads, params.memory.optimizer) == (0, 0, 0)
    assert params.memory.host == plain.params + plain.grads + plain.optimizer
    assert optimizer.memory.optimizer == 0 and optimizer.memory.host == plain.optimizer
    assert optimizer.memory.params == plain.params
    assert activations.memory.activations < optimizer.memory.activations
    assert activations.memory.host == plain.optimizer + activations.memory.host_activations > plain.optimizer
    hw = problem.hardware
    round_trip = 2 * plain.optimizer / (hw.host_link_bandwidth_gbps * 1e9)
    assert optimizer.time.offload == pytest.approx(round_trip)
    assert optimizer.time.total > planner.estimate(base).time.total
    # the update of offloaded parameters runs at the host's memory bandwidth, not the device's
    assert params.time.optimizer > planner.estimate(base).time.optimizer


def test_host_memory_is_a_constraint():
    cfg = compose_config(*QWEN3_8B_ON_ONE_H100, "hardware.host_memory_gb=32")
    planner = Planner(problem_from_config(cfg, 1))
    est = planner.estimate(Layout(micro_batch=8, recompute="full", offload="optimizer"))
    assert not est.fits and "of host memory per device" in est.reason
    assert planner.search().best is None  # 61 GiB of AdamW states alone exceed 32 GB of host RAM


def test_gated_deltanet_cp_traffic_is_the_state_not_the_sequence():
    """Under cp the attention layers move K/V (linear in the length), the Gated DeltaNet layers only their carried
    state: the hybrid's cp time is the attention layers' share of an all-attention model's, plus a part constant
    in the length."""
    def cp_seconds(seq_len, *extra):
        cfg = compose_config("model=qwen3_5_27b", "hardware=h100", "parallel.dp=1", "parallel.cp=4",
                             "train.micro_batch_size=1", "train.global_batch_size=1", f"train.seq_len={seq_len}",
                             *extra)
        return Planner(problem_from_config(cfg, 4)).estimate(layout_from_config(cfg.parallel, cfg.train)).time.cp

    attention_only = ["model.layer_types=[" + ",".join(["full_attention"] * 64) + "]"]
    short, long = ((cp_seconds(n), cp_seconds(n, *attention_only)) for n in (8192, 32768))
    assert long[1] == pytest.approx(4 * short[1], rel=1e-6)  # K/V: linear in the length
    state_short, state_long = (hybrid - dense / 4 for hybrid, dense in (short, long))  # one layer in four attends
    assert state_short > 0 and state_long == pytest.approx(state_short, rel=1e-6)
