"""The planner and validation share one rule set: `parallel=auto` builds exactly the layout the planner ranked
first, and every layout `task=plan` ranks passes validation when set explicitly (speedllm.parallel.rules)."""

from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from speedllm.config import compose_config
from speedllm.config.resolve import choose_layout
from speedllm.planner.layout import layout_from_config, uneven
from speedllm.planner.search import Planner, problem_from_config

pytestmark = pytest.mark.unit


def auto(*overrides):
    """The config `parallel=auto <overrides>` resolves to (in process: choose_layout), and the planner's ranking."""
    cfg = compose_config("parallel=auto", *overrides)
    OmegaConf.set_struct(cfg, False)
    planner = Planner(problem_from_config(cfg, cfg.launcher.nnodes * cfg.launcher.nproc_per_node))
    result = planner.search()
    choose_layout(cfg)
    return cfg, planner, result


def test_parallel_auto_builds_the_layout_it_announces_cp_mode_included(capsys):
    cfg, planner, result = auto("task=dryrun", "model=qwen3_8b", "hardware=h100", "launcher.nproc_per_node=8",
                                "train.seq_len=32768")
    first = result.best.layout
    announced = capsys.readouterr().out
    assert f"parallel=auto: {first.short()} on 8 device(s)" in announced
    assert first.cp > 1 and first.cp_mode != "allgather"  # the case that was built as allgather
    assert layout_from_config(cfg.parallel, cfg.train) == first
    assert cfg.parallel.pp_layers == uneven(planner.split(first))


# (model, hardware, devices, train.seq_len, train.global_batch_size, optim): dense and MoE, 0.6B to 235B, long
# context, a device too small without offload, Muon; the hybrid family (Qwen3.5 dense and MoE, Qwen3-Next)
GRID = [
    ("qwen3_0.6b", "h100", 8, 4096, 64, "adamw"),
    ("qwen3_8b", "h100", 8, 32768, 16, "adamw"),
    ("qwen3_8b", "h100", 1, 4096, 8, "adamw"),
    ("qwen3_8b", "npu_a2", 16, 4096, 128, "muon"),
    ("qwen3_30b_a3b", "npu_a2", 16, 4096, 128, "adamw"),
    ("qwen3_235b_a22b", "h200", 32, 4096, 64, "adamw"),
    ("qwen3_5_27b", "h100", 8, 4096, 64, "adamw"),
    ("qwen3_5_35b_a3b", "h100", 8, 4096, 64, "adamw"),
    ("qwen3_next_80b_a3b", "h100", 8, 4096, 64, "adamw"),
]


def test_every_ranked_layout_passes_validation_and_auto_builds_the_first_row():
    """For each grid point: every layout the plan ranks (all that fit, not only the printed rows), set explicitly
    as parallel=auto would write it, passes validation's layout rules on task=pretrain; parallel=auto builds the
    first row field by field."""
    from speedllm.config.validate import check_world, validate_layout
    from speedllm.planner import device_count
    from speedllm.planner.layout import apply_layout

    checked = 0
    for model, hardware, world, seq_len, batch, optim in GRID:
        cfg = compose_config("task=pretrain", "parallel=auto", "run_dir=/unused", f"model={model}",
                             f"hardware={hardware}", f"launcher.nproc_per_node={world}", f"train.seq_len={seq_len}",
                             f"train.global_batch_size={batch}", f"optim={optim}")
        explicit = OmegaConf.to_object(cfg)  # plain dataclasses: the same rules, without OmegaConf's per-key cost
        planner = Planner(problem_from_config(cfg, device_count(cfg)))  # what task=plan ranks
        ranked = planner.search().fitting
        assert ranked, (model, hardware, world)
        for est in ranked:
            apply_layout(est.layout, explicit.parallel, explicit.train, uneven(planner.split(est.layout)))
            validate_layout(explicit, world)
            check_world(explicit, world)
        checked += len(ranked)
        OmegaConf.set_struct(cfg, False)
        choose_layout(cfg)
        assert layout_from_config(cfg.parallel, cfg.train) == ranked[0].layout, (model, hardware, world)
        assert cfg.parallel.pp_layers == uneven(planner.split(ranked[0].layout))
    print(f"{checked} ranked layouts validated over {len(GRID)} plans")
    assert checked > 1000


def test_plan_and_launch_refuse_a_sequence_past_the_positions_with_one_message():
    from speedllm.config.resolve import resolve
    from speedllm.errors import UserError

    said = set()
    for overrides in (["task=plan"], ["task=plan", "parallel=auto"], ["task=pretrain", "parallel=auto"],
                      ["task=pretrain", "parallel=tp8"]):
        cfg = compose_config(*overrides, "model=qwen3_8b", "hardware=h100", "launcher.nproc_per_node=8",
                             "train.seq_len=65536", "run_dir=/unused")
        with pytest.raises(UserError) as e:
            resolve(cfg)
        said.add(str(e.value))
    assert said == {"train.seq_len=65536 exceeds max_position_embeddings=40960 of model qwen3_8b; lower "
                    "train.seq_len, or extend the model with model.rope_scaling (e.g. yarn) and a larger "
                    "model.max_position_embeddings"}


def test_rejection_reasons_name_keys_not_internal_lists():
    """64 devices and a 28-layer model: pipelines longer than the model are not searched (parallel.pp_layers
    could not express a stage without a layer), and no reason prints a stage list."""
    planner = Planner(problem_from_config(compose_config("model=qwen3_0.6b", "hardware=h100",
                                                         "launcher.nproc_per_node=64", "train.seq_len=4096",
                                                         "train.global_batch_size=256"), 64))
    result = planner.search()
    assert result.invalid and not [reason for reason in result.invalid if "[" in reason]
    assert all(e.layout.pp * e.layout.vpp <= 28 for e in result.fitting + result.too_big)


def test_muon_with_parameter_offload_is_refused_and_the_plan_never_picks_it():
    from speedllm.config.validate import check_parallel
    from speedllm.errors import UserError

    with pytest.raises(UserError, match=r"^parallel.offload=params with optim=muon: the update would gather every "
                                        "hidden matrix and run its Newton-Schulz iteration on the host"):
        check_parallel(compose_config("optim=muon", "parallel.offload=params"))
    cfg = compose_config("model=qwen3_8b", "hardware=h100", "launcher.nproc_per_node=1", "train.seq_len=4096",
                         "train.global_batch_size=8", "optim=muon")
    result = Planner(problem_from_config(cfg, 1)).search()
    assert result.best.layout.offload != "none"  # 8B does not fit one H100 without offload
    assert {e.layout.offload for e in result.fitting + result.too_big} <= {"none", "optimizer"}


def test_plan_counts_muons_one_buffer_per_matrix_and_its_newton_schulz():
    """optim=muon keeps one momentum buffer per hidden matrix and AdamW's two moments for the rest
    (muon_param_groups of the real model); every rank runs Newton-Schulz on every matrix it holds."""
    import math

    import torch

    from speedllm.models.qwen3 import Qwen3
    from speedllm.planner.layout import Layout
    from speedllm.planner.memory import MASTER_BYTES
    from speedllm.train.optimizer import muon_param_groups

    base = ("model=qwen3_0.6b", "hardware=h100", "launcher.nproc_per_node=1", "train.seq_len=4096",
            "train.global_batch_size=8")
    cfg = compose_config(*base, "optim=muon")
    with torch.device("meta"):
        groups = muon_param_groups(Qwen3(cfg.model), False)
    muon = [p.shape for g in groups if g["muon"] for p in g["params"]]
    numel = sum(p.numel() for g in groups for p in g["params"])
    muon_numel = sum(math.prod(s) for s in muon)
    flops = sum(4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3 for s in muon)
    layout = Layout(micro_batch=1, recompute="full")
    with_muon = Planner(problem_from_config(cfg, 1)).estimate(layout)
    with_adamw = Planner(problem_from_config(compose_config(*base), 1)).estimate(layout)
    assert with_muon.memory.optimizer == (2 * numel - muon_numel) * MASTER_BYTES
    assert with_adamw.memory.optimizer == 2 * numel * MASTER_BYTES
    hw = cfg.hardware  # one device: nothing to gather; 5 bfloat16 Newton-Schulz iterations
    extra = with_muon.time.optimizer - with_adamw.time.optimizer
    assert extra == pytest.approx(cfg.optim.ns_steps * flops / (hw.peak_tflops.bfloat16 * 1e12
                                                                 * cfg.plan.compute_efficiency))


def test_dry_run_of_muon_holds_the_planned_bytes():
    import torch.distributed as dist

    from speedllm.config.schema import typed
    from speedllm.tasks.dryrun import build_rank

    cfg = compose_config("task=dryrun", "hardware=cpu", "model=qwen3_moe_tiny", "parallel=ep2", "parallel.dp=2",
                         "launcher.nproc_per_node=2", "optim=muon", "run_dir=/unused")
    try:
        report = build_rank(typed(cfg), 1, 2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert (report.params, report.grads, report.optimizer) == report.planned
    assert report.optimizer < 2 * report.params  # one buffer for Muon's matrices


def test_dualpipev_sets_its_own_vpp_and_says_it_runs_without_overlap(capsys):
    from speedllm.config.resolve import resolve_layout
    from speedllm.config.validate import check_parallel

    cfg = compose_config("model=qwen3_0.6b", "parallel=pp2", "parallel.pp_schedule=DualPipeV", "task=doctor")
    resolve_layout(cfg)
    assert (cfg.parallel.pp, cfg.parallel.vpp) == (2, 2)
    check_parallel(cfg)
    assert "DualPipeV: torch's ScheduleDualPipeV without an overlap function runs each paired forward and " \
           "backward one after the other" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ every task

TASKS = ("pretrain", "sft", "dpo", "grpo", "distill", "serve")
# what each task needs to be composed: DPO's pairs (not read: validation's layout rules read no file), distill's
# teacher (a config.json, written per test), a served checkpoint
TASK_ARGS = {"dpo": ["data.input=pairs.jsonl"], "serve": ["checkpoint.load_hf=unused"],
             "grpo": ["rl.prompts_per_step=16"]}  # 16 data-parallel ranks sample a prompt each


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """An HF directory holding qwen3_0.6b's config.json: a teacher with the Qwen3 vocabulary of every big model."""
    from speedllm.models.hf_adapter import hf_config

    path = tmp_path_factory.mktemp("teacher")
    hf_config(compose_config("model=qwen3_0.6b").model).save_pretrained(path)
    return path


def check_task_plan(task, model, hardware, world, seq_len, batch, teacher_dir):
    """Every layout the planner ranks for `task` (what task=plan plan.task=<task> prints, all rows) and what
    parallel=auto writes into the config pass the task's layout validation (its SPEC's rules included); where none
    fits, parallel=auto says so in one line. Returns the layouts checked."""
    from speedllm.config.validate import check_world, validate_layout
    from speedllm.errors import UserError
    from speedllm.planner.layout import apply_layout
    from speedllm.tasks import task_spec

    extra = TASK_ARGS.get(task, []) + ([f"distill.teacher={teacher_dir}"] if task == "distill" else [])
    cfg = compose_config(f"task={task}", "parallel=auto", "run_dir=/unused", f"model={model}",
                         f"hardware={hardware}", f"launcher.nproc_per_node={world}", f"train.seq_len={seq_len}",
                         f"train.global_batch_size={batch}", *extra)
    spec = task_spec(task)
    planner = Planner(problem_from_config(cfg, world, spec))
    ranked = [e for e in [planner.inference_layout()] if e is not None] if spec.inference else \
        planner.search().fitting
    explicit = OmegaConf.to_object(cfg)
    for est in ranked:
        apply_layout(est.layout, explicit.parallel, None if spec.inference else explicit.train,
                     uneven(planner.split(est.layout)))
        validate_layout(explicit, world)
        check_world(explicit, world)
    OmegaConf.set_struct(cfg, False)
    if not ranked:
        with pytest.raises(UserError, match="^parallel=auto: no layout of ") as e:
            choose_layout(cfg)
        assert "\n" not in str(e.value)
        return []
    choose_layout(cfg)
    validate_layout(cfg, world)
    check_world(cfg, world)
    assert layout_from_config(cfg.parallel, cfg.train if not spec.inference else explicit.train) == \
        replace(ranked[0].layout, **({} if not spec.inference else {"micro_batch": explicit.train.micro_batch_size}))
    return [est.layout for est in ranked]


def test_every_task_plans_only_layouts_it_accepts(teacher_dir):
    """Random draws of model (dense, MoE, hybrid) x hardware x world size x sequence and batch, each planned for
    every task: every ranked layout and parallel=auto's pick validate for that task."""
    import random

    rng = random.Random(46)
    dense, moe = ["qwen3_0.6b", "qwen3_8b", "qwen3_14b", "qwen3_5_9b"], ["qwen3_30b_a3b", "qwen3_5_35b_a3b"]
    draws = [(rng.choice(models), rng.choice(["h100", "h200", "npu_a2"]), rng.choice([2, 8, 16]),
              rng.choice([2048, 4096]), rng.choice([32, 64, 128])) for models in (dense, moe, dense, moe)]
    checked = {}
    for draw in draws:
        for task in TASKS:
            checked[(task, *draw)] = len(check_task_plan(task, *draw, teacher_dir))
    print(checked)
    for task in TASKS:  # each task has plans that fit, and they validate
        assert sum(n for key, n in checked.items() if key[0] == task), task
    assert sum(checked.values()) > 100


@pytest.mark.parametrize("model", ["qwen3_8b", "qwen3_30b_a3b"])
@pytest.mark.parametrize("world", [8, 16])
@pytest.mark.parametrize("task", ["grpo", "dpo"])
def test_parallel_auto_picks_a_layout_grpo_and_dpo_run(model, world, task, teacher_dir, capsys):
    """The cases that announced a pipeline layout and then refused it: now parallel=auto picks one without pipeline
    stages, which validation accepts."""
    layouts = check_task_plan(task, model, "h100", world, 4096, 64, teacher_dir)
    assert all(lay.pp == 1 for lay in layouts) and "parallel=auto: tp" in capsys.readouterr().out


def test_parallel_auto_says_in_one_line_that_no_layout_passes_the_tasks_rules():
    """qwen3_30b_a3b (4 kv heads, router replay refusing tp) on 16 devices leaves dp=16, which 8 prompts per step
    cannot feed: one line naming rl.prompts_per_step, not a layout that validation then refuses."""
    from speedllm.errors import UserError

    cfg = compose_config("task=grpo", "parallel=auto", "model=qwen3_30b_a3b", "hardware=h100",
                         "launcher.nproc_per_node=16", "rl.prompts_per_step=8")
    OmegaConf.set_struct(cfg, False)
    with pytest.raises(UserError, match=r"^parallel=auto: no layout of model qwen3_30b_a3b on 16 x h100 passes the "
                                        r"rules of task=grpo \(.*rl.prompts_per_step=8 must be divisible by "
                                        r"parallel.dp=16") as e:
        choose_layout(cfg)
    assert "\n" not in str(e.value)


def test_dpo_plan_counts_both_replies_of_a_pair_and_the_reference():
    """task=dpo's micro-batch of B pairs runs 2B rows through the model (tasks/dpo.py: [B, 2, S] -> [R, S]), all
    kept for one backward: the plan's activations are pretraining's at twice the micro-batch; with full fine-tuning
    the frozen reference holds the model's fp32 weights again (under FSDP2 its root unit gathered)."""
    from speedllm.planner.layout import Layout
    from speedllm.tasks import task_spec

    base = ("model=qwen3_0.6b", "hardware=h100", "train.seq_len=2048", "train.global_batch_size=16")
    dpo = Planner(problem_from_config(compose_config("task=dpo", *base), 2, task_spec("dpo")))
    plain = Planner(problem_from_config(compose_config(*base), 2))
    (pairs,), (rows,) = dpo.rank_memories(Layout(dp=2, micro_batch=2)), plain.rank_memories(Layout(dp=2, micro_batch=4))
    m = dpo.p.model
    root = 2 * (m.vocab_size * m.hidden_size + m.hidden_size)  # bf16, gathered while the loss reads it
    assert pairs.activations == rows.activations > 0
    assert pairs.teacher == pairs.params + root and rows.teacher == 0


def test_every_task_file_has_the_spec_its_module_declares():
    """Each conf/task file's module has a SPEC (or trains as pretraining does) that agrees with the file on whether
    the task runs a trained model (planning reads the one, validation and the runtime the other)."""
    from speedllm.paths import CONF
    from speedllm.tasks import task_spec

    for path in sorted((CONF / "task").glob("*.yaml")):
        task = OmegaConf.load(path).task
        assert task_spec(path.stem).inference == bool(task.get("inference", False)), path.stem


@pytest.mark.parametrize("overrides, message", [
    (["plan.task=grpo", "rl.mini_batches=0"], "rl.mini_batches=0 must be >= 1; set rl.mini_batches to such a value"),
    (["plan.task=plan"], "plan.task=plan is not a task to plan; use one of "),
])
def test_task_plan_checks_the_planned_tasks_values(overrides, message):
    """task=plan reads plan.task's SPEC: its value rules hold before the planner divides by them."""
    from speedllm.config.validate import validate_values
    from speedllm.errors import UserError

    with pytest.raises(UserError) as e:
        validate_values(compose_config("task=plan", "data=rl_demo", *overrides))
    assert str(e.value).startswith(message)
