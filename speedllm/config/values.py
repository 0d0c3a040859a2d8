"""Value rules: each key on its own (choices, ranges), the few rules between keys of one group, and the
sampling/serving settings of the tasks that run a trained model.
"""

import dataclasses
import math
import os

from omegaconf import DictConfig, OmegaConf

from speedllm.errors import UserError
from speedllm.generation.sampling import MIN_TEMPERATURE
from speedllm.hardware import AUTO, DTYPES
from speedllm.models.config import PROJECTIONS
from speedllm.models.qwen3 import is_moe_layer
from speedllm.ops import IMPLEMENTATIONS
from speedllm.parallel.rules import OFFLOAD, PP_SCHEDULES, divisors, sequence_errors
from speedllm.paths import CONF
from speedllm.planner.spec import above, at_least, fraction
from speedllm.quant import QUANT_NAMES
from speedllm.tasks import planned_spec, task_spec
from speedllm.train.distill_loss import LOSSES
from speedllm.train.muon import ADJUST_LR_FNS, NS_DTYPES
from speedllm.train.schedule import SCHEDULES


CHOICES = {
    "hardware.device": ("cpu", "cuda", "npu"),
    "hardware.backend": ("gloo", "nccl", "hccl"),
    "hardware.ops": IMPLEMENTATIONS,
    "hardware.dtype": (*DTYPES, AUTO),
    "parallel.cp_mode": ("allgather", "ring", "ulysses", "hybrid"),
    "parallel.pp_schedule": PP_SCHEDULES,
    "parallel.offload": OFFLOAD,
    "train.recompute": ("none", "selective", "full"),
    "optim.schedule": SCHEDULES,
    "optim.ns_dtype": tuple(NS_DTYPES),  # muon's keys: null (not set, or another optimizer) passes
    "optim.adjust_lr_fn": ADJUST_LR_FNS,
    "data.format": ("pretrain", "alpaca", "sharegpt", "messages", "pairs"),
    "data.loss_on": ("all", "assistant", "last"),
    "data.overlong": ("truncate", "drop"),
    "data.on_error": ("fail", "skip"),
    "convert.to": ("hf", "dcp", "peft"),
    "launcher.rdzv_backend": ("c10d", "static", "etcd", "etcd-v2"),
    "quant.name": QUANT_NAMES,
    "finetune.name": ("full", "lora", "qlora"),
    "evaluate.split": ("train", "valid", "test"),
    "rl.loss_agg": ("seq_mean", "token_mean", "constant"),
    "rl.importance": ("token", "sequence"),
    "rl.old_logprobs": ("rollout", "recompute"),
    "rl.rollout_correction": ("none", "tis", "mis"),
    "distill.loss": LOSSES,
    "distill.teacher_parallel": ("same", "replicate"),
    "distill.teacher_quant": ("none", "int8_wo"),
}


LORA_TARGETS = (*PROJECTIONS, "experts")


def _finite(v) -> bool:
    return all(math.isfinite(x) for x in (v if isinstance(v, list) else [v]))


def hybrid_model_errors(m) -> list:
    """What keeps model `m`'s layer kinds from being built: its dense MLP width, layer_types and Gated DeltaNet heads."""
    errors = []
    if m.intermediate_size < 1 and not all(is_moe_layer(m, i) for i in range(m.num_hidden_layers)):
        errors.append(f"model.intermediate_size={m.intermediate_size} must be >= 1: model {m.name} has dense MLP "
                      "layers; set model.intermediate_size")
    kinds = ("full_attention", "linear_attention")
    if m.layer_types and (len(m.layer_types) != m.num_hidden_layers or not set(m.layer_types) <= set(kinds)):
        errors.append(f"model.layer_types must list {m.num_hidden_layers} entries (num_hidden_layers), each one of "
                      f"{', '.join(kinds)}; fix model.layer_types (or leave it empty: all full_attention)")
    elif "linear_attention" in m.layer_types:
        dims = (m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim,
                m.linear_conv_kernel_dim)
        if min(dims) < 1 or m.linear_num_value_heads % m.linear_num_key_heads:
            errors.append("model.linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, "
                          "linear_value_head_dim and linear_conv_kernel_dim must be >= 1, the key heads dividing the "
                          f"value heads (now {', '.join(map(str, dims))}); fix them")
    rotary = int(m.head_dim * m.partial_rotary_factor)
    if not 0 < m.partial_rotary_factor <= 1 or rotary % 2:
        errors.append(f"model.partial_rotary_factor={m.partial_rotary_factor} must be in (0, 1] and give an even "
                      f"number of rotary dims of head_dim={m.head_dim} (now {rotary}); fix it")
    return errors


# key -> (test, what it must be): values a library would reject later, or that would silently do nothing; a task's
# own keys are in its SPEC (speedllm.planner.spec.TaskSpec.values)
VALUE_RULES = {
    **{f"model.{k}": at_least(1) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "head_dim",
                                           "max_position_embeddings")},
    "model.intermediate_size": at_least(0),  # 0: no dense MLP (every layer MoE); checked with the layers below
    "model.rope_theta": above(0),
    "model.rms_norm_eps": above(0),
    "model.num_experts": at_least(0),
    **{f"train.{k}": at_least(1) for k in ("steps", "seq_len", "micro_batch_size", "global_batch_size", "log_every",
                                           "eval_steps", "max_bad_steps")},
    # loss_chunk_size 0: chunks by the logits budget (speedllm.ops.loss.chunk_rows)
    **{f"train.{k}": at_least(0) for k in ("eval_every", "grad_clip", "stop_after", "loss_chunk_size")},
    "optim.lr": above(0),
    "optim.min_lr": at_least(0),
    "optim.weight_decay": at_least(0),
    "optim.eps": at_least(0),
    "optim.warmup_steps": at_least(0),
    "optim.decay_fraction": (fraction, "in [0, 1]"),
    "optim.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1), like [0.9,0.95]"),
    "optim.momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.ns_steps": (lambda v: 1 <= v < 100, "in [1, 99]"),
    "optim.ns_coefficients": (lambda v: len(v) == 3, "three values a,b,c like [3.4445,-4.775,2.0315]"),
    "optim.adamw_lr": above(0),
    "optim.adamw_weight_decay": at_least(0),
    "optim.adamw_eps": at_least(0),
    "optim.adamw_betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1), like [0.9,0.95]"),
    "checkpoint.every": at_least(0),
    "launcher.nnodes": at_least(1),
    "launcher.nproc_per_node": at_least(0),
    "launcher.node_rank": at_least(0),
    "launcher.max_restarts": at_least(0),
    "launcher.monitor_interval": above(0),
    "launcher.rdzv_timeout": above(0),
    "data.workers": at_least(1),
    "data.loader_workers": at_least(0),
    "hardware.memory_gb": above(0),
    "plan.top": at_least(1),
    "plan.show_rejected": at_least(0),
    "plan.compute_efficiency": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "plan.memory_margin": (lambda v: 0 <= v < 1, "in [0, 1)"),
}


# list values whose rule is on the whole list (a pair of betas), not on each entry (adafactor's eps pair)
WHOLE_LISTS = ("optim.betas", "optim.adamw_betas", "optim.ns_coefficients")


def check_choices(cfg: DictConfig) -> None:
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and value not in allowed:
            raise UserError(f"{key}={value} is not one of {', '.join(allowed)}; pick one of them")


def check_known_keys(cfg: DictConfig, where: str = "") -> None:
    """Keys a `+key=value` override added to a typed section (the schema refuses plain `key=value` itself)."""
    schema = OmegaConf.get_type(cfg)
    if where and not dataclasses.is_dataclass(schema):
        return  # a free-form dict (model.rope_scaling)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else set()
    for key in cfg.keys():
        dotted = f"{where}{key}"
        if known and key not in known and dotted != "run_dir":
            raise UserError(f"{dotted} is not a setting (no such key in {schema.__name__}); check the spelling "
                            "(`python launch.py --cfg job` prints every key) and drop the +")
        node = cfg._get_node(key)
        if isinstance(node, DictConfig) and not node._is_none():
            check_known_keys(node, f"{dotted}.")


def check_task_name(cfg: DictConfig) -> None:
    """task.name is what the launcher and the rules go by: it must be a conf/task file, and that file's task."""
    names = sorted(p.stem for p in (CONF / "task").glob("*.yaml"))
    name = cfg.task.name
    if name not in names:
        raise UserError(f"task.name={name} is not a task; choose the task with task=<{'|'.join(names)}>")
    target = OmegaConf.load(CONF / "task" / f"{name}.yaml").task._target_
    if cfg.task._target_ != target:
        raise UserError(f"task.name={name} but task._target_={cfg.task._target_} runs another task; choose the "
                        f"task with task={name}, not task.name")
    if task_spec(name).plans is not None:  # task=plan, task=dryrun: the task they plan for
        planned = [n for n in names if task_spec(n).plans is None]
        if cfg.plan.task not in planned:
            raise UserError(f"plan.task={cfg.plan.task} is not a task to plan; use one of {', '.join(planned)}")


def check_dtype(cfg: DictConfig) -> None:
    """The dtype must be one the hardware profile has kernels (and a speed) for; batch-invariant kernels are
    CPU ones."""
    hw = cfg.hardware
    if hw.batch_invariant and hw.device != "cpu":
        raise UserError(f"hardware.batch_invariant=true has CPU kernels only (speedllm.ops.batch_invariant), not "
                        f"{hw.device} ones; set hardware.batch_invariant=false on hardware={hw.name}")
    if hw.dtype not in hw.peak_tflops:
        raise UserError(f"hardware.dtype={hw.dtype}: hardware={hw.name} ({hw.device}) lists no {hw.dtype} kernels "
                        f"(hardware.peak_tflops has {', '.join(hw.peak_tflops)}); use hardware.dtype="
                        f"{'|'.join(hw.peak_tflops)}")


def check_values(cfg: DictConfig) -> None:
    """Each value on its own (the shared table, then the task's and, for task=plan, the planned task's): in range,
    finite; then the few rules between two keys of one group."""
    for key, (ok, must_be) in {**VALUE_RULES, **task_spec(cfg.task.name).values, **planned_spec(cfg).values}.items():
        value = OmegaConf.select(cfg, key)
        if value is None:  # an optimizer without this argument
            continue
        listed = OmegaConf.is_list(value)
        # a rule holds for each entry of a list (adafactor's eps pair), except betas, which is one value
        items = [list(value)] if key in WHOLE_LISTS else [v for v in value if v is not None] if listed else [value]
        if not all(_finite(v) and ok(v) for v in items):
            raise UserError(f"{key}={list(value) if listed else value} must be {must_be}; set {key} to such a value")
    m, o, lc = cfg.model, cfg.optim, cfg.launcher
    if m.num_attention_heads % m.num_key_value_heads:
        raise UserError(f"model.num_key_value_heads={m.num_key_value_heads} must divide model.num_attention_heads="
                        f"{m.num_attention_heads} (grouped-query attention); use one of {divisors(m.num_attention_heads)}")
    if m.num_experts > 0 and not (1 <= m.num_experts_per_tok <= m.num_experts and m.moe_intermediate_size >= 1):
        raise UserError(f"model.num_experts={m.num_experts} needs model.num_experts_per_tok in [1, {m.num_experts}] "
                        f"and model.moe_intermediate_size >= 1 (now {m.num_experts_per_tok}, {m.moe_intermediate_size})")
    for error in hybrid_model_errors(m):
        raise UserError(error)
    if not cfg.task.inference:  # before parallel=auto plans: the positions bound every layout alike
        for error in sequence_errors(m, cfg.train.seq_len, tp=1, cp=1, sequence_parallel=False):
            raise UserError(error)
    if o.min_lr > o.lr:
        raise UserError(f"optim.min_lr={o.min_lr} exceeds optim.lr={o.lr}; lower optim.min_lr")
    if lc.node_rank >= lc.nnodes:
        raise UserError(f"launcher.node_rank={lc.node_rank} must be below launcher.nnodes={lc.nnodes} "
                        f"(nodes count from 0)")
    if cfg.task.name in ("pretrain", "sft", "distill", "evaluate"):  # the tasks that split their data
        from speedllm.data.datasets import parse_split

        parse_split(cfg.data.split)


def check_model(cfg: DictConfig) -> None:
    from speedllm.models.rope import check_rope_scaling

    if cfg.model.rope_scaling:
        check_rope_scaling(cfg.model.rope_scaling, "model.rope_scaling")


def check_inference(cfg: DictConfig) -> None:
    """Sampling and evaluation settings of the tasks that run a trained model, and its weights."""
    gen = cfg.generate
    rules = [
        (gen.max_new_tokens >= 1, f"generate.max_new_tokens={gen.max_new_tokens} must be >= 1"),
        (gen.batch_size >= 1, f"generate.batch_size={gen.batch_size} must be >= 1"),
        (gen.temperature == 0 or gen.temperature >= MIN_TEMPERATURE,
         f"generate.temperature={gen.temperature} must be 0 (greedy) or at least {MIN_TEMPERATURE} (smaller ones "
         "overflow the probabilities)"),
        (gen.top_k >= 0, f"generate.top_k={gen.top_k} must be >= 0 (0 = off)"),
        (0 < gen.top_p <= 1, f"generate.top_p={gen.top_p} must be in (0, 1] (1 = off)"),
        (gen.repetition_penalty > 0, f"generate.repetition_penalty={gen.repetition_penalty} must be > 0 (1 = off)"),
        (cfg.evaluate.steps >= 1, f"evaluate.steps={cfg.evaluate.steps} must be >= 1"),
        (cfg.evaluate.batch_size >= 1, f"evaluate.batch_size={cfg.evaluate.batch_size} must be >= 1"),
    ]
    include = cfg.evaluate.include_path
    if cfg.task.name == "evaluate" and include is not None and not os.path.isdir(include):
        rules.append((False, f"evaluate.include_path={include} is not a directory; point it at a directory of "
                             "lm-eval task YAMLs"))
    for ok, message in rules:
        if not ok:
            raise UserError(message)
