"""Cross-field checks on a composed config, run before any process starts.

Each rule raises UserError with ONE line naming the key(s), their values and a fix. Hydra's schema has already
rejected unknown keys and wrong types; what is left are rules that span several keys or touch the machine.
"""

import dataclasses
import importlib.util
import math
import os
from glob import glob

from omegaconf import DictConfig, OmegaConf

from speedllm.config.locations import check_outputs
from speedllm.errors import UserError
from speedllm.generation.sampling import MIN_TEMPERATURE
from speedllm.hardware import AUTO, DTYPES
from speedllm.models.config import PROJECTIONS
from speedllm.models.qwen3 import is_moe_layer
from speedllm.native import isa
from speedllm.ops import IMPLEMENTATIONS
from speedllm.parallel.rules import (
    OFFLOAD,
    PP_SCHEDULES,
    batch_errors,
    compile_errors,
    distill_layout_errors,
    divisors,
    inference_layout_errors,
    layout_errors,
    offload_errors,
    optimizer_layout_errors,
    pipeline_batch_errors,
    qlora_layout_errors,
    sequence_errors,
)
from speedllm.paths import CONF
from speedllm.quant import FLOAT8_RECIPES, QUANT_NAMES, TRAINING
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


def _at_least(low):
    return (lambda v: v >= low), f">= {low}"


def _above(low):
    return (lambda v: v > low), f"> {low}"


def _fraction(v) -> bool:
    return 0 <= v <= 1


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


# key -> (test, what it must be): values a library would reject later, or that would silently do nothing.
VALUE_RULES = {
    **{f"model.{k}": _at_least(1) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                            "num_attention_heads", "num_key_value_heads", "head_dim",
                                            "max_position_embeddings")},
    "model.intermediate_size": _at_least(0),  # 0: no dense MLP (every layer MoE); checked with the layers below
    "model.rope_theta": _above(0),
    "model.rms_norm_eps": _above(0),
    "model.num_experts": _at_least(0),
    **{f"train.{k}": _at_least(1) for k in ("steps", "seq_len", "micro_batch_size", "global_batch_size", "log_every",
                                            "eval_steps", "max_bad_steps")},
    # loss_chunk_size 0: chunks by the logits budget (speedllm.ops.loss.chunk_rows)
    **{f"train.{k}": _at_least(0) for k in ("eval_every", "grad_clip", "stop_after", "loss_chunk_size")},
    "optim.lr": _above(0),
    "optim.min_lr": _at_least(0),
    "optim.weight_decay": _at_least(0),
    "optim.eps": _at_least(0),
    "optim.warmup_steps": _at_least(0),
    "optim.decay_fraction": (_fraction, "in [0, 1]"),
    "optim.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1), like [0.9,0.95]"),
    "optim.momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.ns_steps": (lambda v: 1 <= v < 100, "in [1, 99]"),
    "optim.ns_coefficients": (lambda v: len(v) == 3, "three values a,b,c like [3.4445,-4.775,2.0315]"),
    "optim.adamw_lr": _above(0),
    "optim.adamw_weight_decay": _at_least(0),
    "optim.adamw_eps": _at_least(0),
    "optim.adamw_betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1), like [0.9,0.95]"),
    "checkpoint.every": _at_least(0),
    "launcher.nnodes": _at_least(1),
    "launcher.nproc_per_node": _at_least(0),
    "launcher.node_rank": _at_least(0),
    "launcher.max_restarts": _at_least(0),
    "launcher.monitor_interval": _above(0),
    "launcher.rdzv_timeout": _above(0),
    "data.workers": _at_least(1),
    "data.loader_workers": _at_least(0),
    "hardware.memory_gb": _above(0),
    "plan.top": _at_least(1),
    "plan.show_rejected": _at_least(0),
    "plan.compute_efficiency": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "plan.memory_margin": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "distill.beta": (_fraction, "in [0, 1]"),
    "distill.temperature": _above(0),
    "distill.ce_weight": (_fraction, "in [0, 1]"),
    "distill.on_policy": (_fraction, "in [0, 1]"),
    "distill.top_k": _at_least(1),  # null: the teacher's whole distribution
    "rl.temperature": _above(0),
    "rl.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "rl.kl_coef": _at_least(0),
    "rl.clip_low": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "rl.clip_high": _at_least(0),
    "rl.overlong_penalty": _at_least(0),
    "rl.rollout_correction_threshold": _above(1),
    "rl.max_turns": _at_least(0),
    "rl.tool_timeout_s": _above(0),
    "rl.tool_max_chars": _above(0),
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


def check_dtype(cfg: DictConfig) -> None:
    """The dtype must be one the hardware profile has kernels (and a speed) for."""
    hw = cfg.hardware
    if hw.dtype not in hw.peak_tflops:
        raise UserError(f"hardware.dtype={hw.dtype}: hardware={hw.name} ({hw.device}) lists no {hw.dtype} kernels "
                        f"(hardware.peak_tflops has {', '.join(hw.peak_tflops)}); use hardware.dtype="
                        f"{'|'.join(hw.peak_tflops)}")


# (what needs it, module, extra): a choice that imports an optional package, checked before anything runs
def _extras(cfg: DictConfig):
    if cfg.quant.name != "none":
        yield f"quant={cfg.quant.name}", "torchao", "quant"
    if cfg.finetune.name == "qlora":
        yield "finetune=qlora", "torchao", "finetune"
    if cfg.task.name == "serve":
        yield "task=serve", "fastapi", "serve"
        yield "task=serve", "uvicorn", "serve"
    if cfg.task.name == "evaluate" and cfg.evaluate.tasks:
        yield "evaluate.tasks", "lm_eval", "eval"
    if cfg.task.name == "distill" and cfg.distill.teacher_quant != "none":
        yield f"distill.teacher_quant={cfg.distill.teacher_quant}", "torchao", "quant"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def check_extras(cfg: DictConfig) -> None:
    for what, module, extra in _extras(cfg):
        if not _installed(module):
            raise UserError(f"{what} needs {module}, which is not installed: pip install 'speedllm[{extra}]' "
                            f"(from a checkout: pip install -e '.[{extra}]')")


def check_values(cfg: DictConfig) -> None:
    """Each value on its own: in range, finite; then the few rules between two keys of one group."""
    for key, (ok, must_be) in VALUE_RULES.items():
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


def check_parallel(cfg: DictConfig) -> None:
    p = cfg.parallel
    errors = layout_errors(cfg.model, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, cp=p.cp, dp=p.dp,
                           schedule=p.pp_schedule, pp_layers=p.pp_layers, cp_mode=p.cp_mode,
                           cp_ulysses=p.cp_ulysses, sequence_parallel=p.sequence_parallel or cfg.task.inference)
    if cfg.task.inference:
        errors += inference_layout_errors(cfg.task.name, pp=p.pp, cp=p.cp, ep=p.ep)
        if p.offload != "none" or cfg.train.activation_offload:
            errors.append(f"task={cfg.task.name} runs a trained model: parallel.offload={p.offload} and "
                          f"train.activation_offload={cfg.train.activation_offload} are training levers; leave them "
                          "at none / false")
    else:
        errors += offload_errors(p.offload, fsdp=p.fsdp, finetune=cfg.finetune.name, optimizer=cfg.optim._target_)
        errors += compile_errors(compile_=cfg.train.compile, pp=p.pp, schedule=p.pp_schedule)
    if errors:
        raise UserError(errors[0])


def check_task(cfg: DictConfig, world_size: int) -> None:
    """The task's `_target_` and the optimizer's must resolve before anything is launched."""
    from hydra.utils import get_method

    from speedllm.train.optimizer import optimizer_errors

    try:
        get_method(cfg.task._target_)
    except Exception as e:  # hydra wraps import and attribute errors alike
        raise UserError(f"task._target_={cfg.task._target_} cannot be imported ({str(e).splitlines()[0]}); "
                        "use one of the tasks in conf/task") from None
    errors = optimizer_errors(cfg.optim)
    if not cfg.task.inference:
        errors += optimizer_layout_errors(cfg.optim._target_, world_size)
    if errors:
        raise UserError(errors[0])


def check_batch(cfg: DictConfig) -> None:
    t, p = cfg.train, cfg.parallel
    errors = [] if cfg.task.name == "dryrun" else batch_errors(  # a dry run builds the ranks, not a step's batch
        global_batch=t.global_batch_size, micro_batch=t.micro_batch_size, dp=p.dp)
    if not cfg.task.inference:  # inference has no training sequence or step
        if cfg.task.name not in ("dryrun", "plan"):  # task=plan says why your layout is not costed
            errors += pipeline_batch_errors(pp=p.pp, vpp=p.vpp, schedule=p.pp_schedule,
                                            pp_microbatches=p.pp_microbatches, global_batch=t.global_batch_size,
                                            micro_batch=t.micro_batch_size, dp=p.dp)
        errors += sequence_errors(cfg.model, t.seq_len, tp=p.tp, cp=p.cp, sequence_parallel=p.sequence_parallel)
    if errors:
        raise UserError(errors[0])


def check_quant(cfg: DictConfig) -> None:
    """quant= fits the task, the hardware and the model's layer widths."""
    q, task, hw, m = cfg.quant, cfg.task.name, cfg.hardware, cfg.model
    if q.name == "none":
        return
    if task in ("pretrain", "sft") and q.name not in TRAINING:
        raise UserError(f"quant={q.name} quantizes a trained model for inference (task=generate/chat/evaluate/"
                        f"convert); to train for int4 use quant=qat_int4, else quant=none")
    if q.name == "float8":
        if q.recipe not in FLOAT8_RECIPES:
            raise UserError(f"quant.recipe={q.recipe} is not one of {', '.join(FLOAT8_RECIPES)}; pick one of them")
        if not hw.float8:
            raise UserError(f"quant=float8 needs float8 matmuls (NVIDIA SM 8.9+: H100/H200, hardware=h100|h200) but "
                            f"hardware={hw.name} ({hw.device}) has none; use quant=none ({hw.dtype}) there, or "
                            "quant=qat_int4 to train for int4 inference")
    if q.name in ("int4_wo", "qat_int4"):
        widths = {"hidden_size": m.hidden_size, "num_attention_heads x head_dim": m.num_attention_heads * m.head_dim}
        if m.num_experts == 0 or m.mlp_only_layers or m.decoder_sparse_step > 1:
            widths["intermediate_size"] = m.intermediate_size
        bad = {k: v for k, v in widths.items() if v % q.group_size}
        if q.group_size not in (32, 64, 128, 256) or bad:
            raise UserError(f"quant.group_size={q.group_size} must be one of 32, 64, 128, 256 and divide every layer "
                            f"input width of model {m.name} ({', '.join(f'{k}={v}' for k, v in widths.items())}); "
                            "pick a divisor")
        # the row-parallel o_proj / down_proj shards hold 1/tp of their input width: whole groups keep tp=1's numbers
        split = {k: v // cfg.parallel.tp for k, v in widths.items() if k != "hidden_size"}
        if cfg.parallel.tp > 1 and cfg.task.inference and any(v % q.group_size for v in split.values()):
            raise UserError(f"quant.group_size={q.group_size} must divide the input width of each tensor-parallel "
                            f"shard under parallel.tp={cfg.parallel.tp} "
                            f"({', '.join(f'{k} / tp={v}' for k, v in split.items())}); pick a divisor")


def check_finetune(cfg: DictConfig) -> None:
    """finetune=lora|qlora settings, a PEFT adapter to start from, and DPO's data and layout."""
    ft, p, task = cfg.finetune, cfg.parallel, cfg.task.name
    if task == "dpo":
        if cfg.data.format != "pairs":
            raise UserError(f"task=dpo needs preference pairs; set data.format=pairs (now {cfg.data.format})")
        if cfg.data.input is None:
            raise UserError("task=dpo needs data.input=<json/jsonl of prompt/chosen/rejected pairs>")
        if p.pp > 1:
            raise UserError(f"task=dpo does not run on pipeline stages (parallel.pp={p.pp}); use parallel.pp=1")
    elif cfg.data.format == "pairs" and task in ("pretrain", "sft", "distill"):
        raise UserError(f"data.format=pairs holds preference pairs for task=dpo, not task={task}; use task=dpo")
    if ft.name == "full":
        if ft.adapter is not None:
            raise UserError(f"finetune.adapter={ft.adapter} needs adapters to load into; add finetune=lora")
        return
    if ft.rank < 1 or ft.alpha <= 0 or not 0 <= ft.dropout < 1:
        raise UserError(f"finetune.rank={ft.rank}, finetune.alpha={ft.alpha}, finetune.dropout={ft.dropout}: need "
                        "rank >= 1, alpha > 0 and 0 <= dropout < 1")
    unknown = [t for t in ft.targets if t not in LORA_TARGETS]
    if unknown or not ft.targets:
        raise UserError(f"finetune.targets={list(ft.targets)}: {unknown or 'empty'} not adaptable; pick from "
                        f"{', '.join(LORA_TARGETS)}")
    if "experts" in ft.targets and not cfg.model.num_experts:
        raise UserError(f"finetune.targets={list(ft.targets)}: model {cfg.model.name} has no experts; leave experts "
                        "out of finetune.targets or use a MoE model")
    if "experts" in ft.targets and ft.dropout > 0:
        raise UserError(f"finetune.dropout={ft.dropout}: LoRA on the experts has no dropout (as PEFT's on parameters,"
                        " which could not load it); set finetune.dropout=0 or leave experts out of finetune.targets")
    if ft.name == "qlora":
        check_qlora(cfg)
    if ft.adapter is not None:
        from speedllm.adapters.peft import read_peft_config

        read_peft_config(ft.adapter, ft)


def check_distill(cfg: DictConfig) -> None:
    """task=distill: its layout, the settings that have no finite loss, and the teacher (speedllm.train.teacher)."""
    from speedllm.train.teacher import check_teacher

    d, p = cfg.distill, cfg.parallel
    for error in distill_layout_errors(pp=p.pp, cp=p.cp, tp=p.tp, dp=p.dp, fsdp=p.fsdp, teacher_quant=d.teacher_quant,
                                       teacher_parallel=d.teacher_parallel, name=p.name):
        raise UserError(error)
    if d.top_k is not None and d.top_k > cfg.model.vocab_size:
        raise UserError(f"distill.top_k={d.top_k} exceeds the vocabulary ({cfg.model.vocab_size}); use a smaller k, "
                        "or distill.top_k=null for the whole distribution")
    reverse = d.loss == "reverse_kl" or d.loss == "jsd" and d.beta == 1
    if d.top_k is not None and reverse:
        raise UserError(f"distill.top_k={d.top_k} with the reverse KL (distill.loss={d.loss}, beta={d.beta}) is "
                        "infinite where the student puts mass outside the teacher's top k; use distill.top_k=null, or "
                        "distill.loss=forward_kl|jsd with beta < 1")
    source = check_teacher(cfg)
    errors = layout_errors(source.model, tp=p.tp, pp=1, vpp=1, ep=p.ep, cp=1, dp=p.dp, schedule=p.pp_schedule,
                           sequence_parallel=p.sequence_parallel)
    if errors:
        raise UserError(f"distill.teacher={d.teacher}: {errors[0]}")


def check_qlora(cfg: DictConfig) -> None:
    """finetune=qlora: the NF4 base is sharded by FSDP2 (dim 0) or held whole in one process; every NF4 weight,
    and each rank's rows of it, must be whole double-quantization blocks (speedllm.quant.nf4)."""
    import torch

    from speedllm.adapters.lora import target_linears
    from speedllm.models.qwen3 import Qwen3
    from speedllm.quant.nf4 import NF4_BLOCK, NF4_SCALER_BLOCK

    p, m, ft = cfg.parallel, cfg.model, cfg.finetune
    for error in qlora_layout_errors(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, dp=p.dp, fsdp=p.fsdp, name=p.name):
        raise UserError(error)
    # the shapes of the linears LoRA adapts, from the meta model (experts are not linears: they stay in full
    # precision); one per name, as the layers of one kind repeat them
    with torch.device("meta"):
        model = Qwen3(m)
    shapes = {name.rsplit(".", 1)[-1]: tuple(linear.weight.shape)
              for name, linear in target_linears(model, ft.targets).items()}
    block = NF4_BLOCK * NF4_SCALER_BLOCK
    for target, (rows, cols) in shapes.items():
        if rows * cols % (block * p.dp) or rows % p.dp:
            raise UserError(f"finetune=qlora: {target}.weight [{rows}, {cols}] does not split into whole NF4 blocks "
                            f"of {block} weights on each of {p.dp} rank(s); leave {target} out of finetune.targets or use "
                            f"finetune=lora for model {m.name}" + (" (or fewer data-parallel ranks)" if p.dp > 1 else ""))


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
    s = cfg.serve
    if cfg.task.name == "serve":
        rules += [
            (1 <= s.port <= 65535, f"serve.port={s.port} must be in 1..65535"),
            (s.max_batch >= 1, f"serve.max_batch={s.max_batch} must be >= 1"),
            (s.max_queue >= 1, f"serve.max_queue={s.max_queue} must be >= 1"),
            (s.max_len >= 2, f"serve.max_len={s.max_len} must be >= 2 (prompt + completion tokens per request)"),
            (s.max_body_bytes >= 1024, f"serve.max_body_bytes={s.max_body_bytes} must be >= 1024"),
            (s.read_timeout > 0, f"serve.read_timeout={s.read_timeout} must be > 0 (seconds)"),
        ]
    include = cfg.evaluate.include_path
    if cfg.task.name == "evaluate" and include is not None and not os.path.isdir(include):
        rules.append((False, f"evaluate.include_path={include} is not a directory; point it at a directory of "
                             "lm-eval task YAMLs"))
    for ok, message in rules:
        if not ok:
            raise UserError(message)


def check_rendezvous(cfg: DictConfig) -> None:
    """Several nodes: node 0's host must resolve here (an unresolvable one would hang the rendezvous)."""
    import socket

    lc = cfg.launcher
    if lc.nnodes == 1 or lc.rdzv_backend not in ("c10d", "static"):
        return
    host, _, port = lc.rdzv_endpoint.rpartition(":")
    try:
        socket.getaddrinfo(host, int(port))
    except (socket.gaierror, ValueError) as e:
        raise UserError(f"launcher.rdzv_endpoint={lc.rdzv_endpoint}: {host or '(no host)'} does not resolve here "
                        f"({e}); give node 0's host name or address and a port, like node0:29500") from None


def check_world(cfg: DictConfig, world_size: int) -> None:
    p = cfg.parallel
    product = p.dp * p.cp * p.tp * p.pp
    if product != world_size:
        raise UserError(f"parallel dp={p.dp} x cp={p.cp} x tp={p.tp} x pp={p.pp} = {product} does not match the world "
                        f"size {world_size} (launcher.nnodes={cfg.launcher.nnodes} x launcher.nproc_per_node="
                        f"{cfg.launcher.nproc_per_node}); set parallel.dp=-1 to infer it or fix the launcher counts")


def check_dryrun(cfg: DictConfig, world_size: int) -> None:
    bad = [r for r in cfg.dryrun.ranks or [] if not 0 <= r < world_size]
    if bad:
        raise UserError(f"dryrun.ranks: rank {bad[0]} is not in the {world_size}-rank job (launcher.nnodes x "
                        f"launcher.nproc_per_node); list ranks from 0 to {world_size - 1}")


def check_device(cfg: DictConfig, nproc_per_node: int) -> None:
    """The hardware profile's device must be here (not for planning, which targets machines the user lacks)."""
    import torch

    hw = cfg.hardware
    if hw.device == "cpu":
        return
    if hw.device == "cuda":
        found = torch.cuda.device_count()
    else:
        from speedllm.hardware import npu_available

        found = torch.npu.device_count() if npu_available() else 0
    if found < nproc_per_node:
        raise UserError(f"hardware={hw.name} needs {nproc_per_node} {hw.device} device(s) per node but {found} "
                        f"found here; use hardware=cpu (or hardware=auto), or lower launcher.nproc_per_node")


def _must_exist(key: str, path: str, fix: str) -> None:
    from speedllm import storage

    if storage.is_url(path):
        return storage.check(key, path, must_exist=True)
    if not (os.path.exists(path) or glob(path)):
        raise UserError(f"{key}={path} does not exist; {fix}")


def check_paths(cfg: DictConfig) -> None:
    ck, d, task = cfg.checkpoint, cfg.data, cfg.task.name
    if ck.load not in (None, "auto"):
        _must_exist("checkpoint.load", ck.load, "point it at a checkpoint directory (or use checkpoint.load=auto)")
    if ck.load_hf is not None:
        _must_exist("checkpoint.load_hf", ck.load_hf, "point it at a Hugging Face model directory")
    if task != "doctor":
        _must_exist("data.tokenizer", d.tokenizer, "point it at a Hugging Face tokenizer directory")
    if task == "preprocess":
        if d.input is None or d.output_prefix is None:
            raise UserError("task=preprocess needs data.input=<file or glob> and data.output_prefix=<prefix>")
        for item in [d.input] if isinstance(d.input, str) else d.input:
            _must_exist("data.input", item, "give a file, a glob or a list of them")
    if d.path is not None and task in ("pretrain", "distill", "evaluate"):
        items = [d.path] if isinstance(d.path, str) else list(d.path)
        for prefix in items[1::2] if len(items) > 1 else items:
            for suffix in (".bin", ".idx"):
                _must_exist("data.path", f"{prefix}{suffix}", "give the prefix of a .bin/.idx pair "
                            "(e.g. made by task=preprocess)")
    if cfg.generate.prompts_file is not None and task == "generate":
        _must_exist("generate.prompts_file", cfg.generate.prompts_file, "one prompt per line, or jsonl")
    if task == "convert":
        if cfg.convert.out is None:
            raise UserError("task=convert needs convert.out=<output directory>")
        source = ck.load_hf if cfg.convert.to == "dcp" else ck.load
        if source is None:
            need = "checkpoint.load_hf=<HF dir>" if cfg.convert.to == "dcp" else "checkpoint.load=<checkpoint dir>"
            raise UserError(f"task=convert convert.to={cfg.convert.to} needs {need}")


def check_hf_model(cfg: DictConfig) -> None:
    """model=hf needs checkpoint.load_hf; any other model= must agree with the config.json it loads.

    Runs first: model=hf's fields are read from that config.json when anything looks at them.
    """
    from speedllm.checkpoint.hf import config_mismatches, read_hf_config

    load_hf, name = cfg.checkpoint.load_hf, cfg.model.name
    if name == "hf" and load_hf is None:
        raise UserError("model=hf takes the model from checkpoint.load_hf's config.json; set "
                        "checkpoint.load_hf=<HF model dir>")
    if load_hf is None:
        return
    _must_exist("checkpoint.load_hf", load_hf, "point it at a Hugging Face model directory")
    read_hf_config(load_hf)
    # task=convert takes the model from its source, whatever model= says
    mismatches = [] if name == "hf" or cfg.task.name == "convert" else config_mismatches(cfg.model, load_hf)
    if mismatches:
        raise UserError(f"checkpoint.load_hf={load_hf}: config.json disagrees with model={name} on "
                        f"{', '.join(mismatches)} (config.json vs model); use model=hf to take the model from "
                        "config.json, or the matching model=")


def validate_values(cfg: DictConfig) -> None:
    """The rules that need no layout: run before the launcher derives the world size from these values."""
    check_known_keys(cfg)
    check_task_name(cfg)
    check_hf_model(cfg)
    check_choices(cfg)
    check_values(cfg)
    check_dtype(cfg)
    check_model(cfg)
    if cfg.task.inference:
        check_inference(cfg)


def check_inputs(cfg: DictConfig) -> None:
    """What an inference task reads: weights, and for task=generate prompts (checked after every value rule)."""
    gen = cfg.generate
    if cfg.task.name == "generate" and gen.prompt is None and gen.prompts_file is None:
        raise UserError("task=generate needs generate.prompt=<text> or generate.prompts_file=<path>")
    if cfg.checkpoint.load is None and cfg.checkpoint.load_hf is None:
        raise UserError(f"task={cfg.task.name} needs weights: checkpoint.load=<checkpoint dir> (from a training "
                        "run) or checkpoint.load_hf=<Hugging Face model dir> (with model=hf)")


def validate_layout(cfg: DictConfig, world_size: int) -> None:
    """The rules on the task, optimizer, layout, batch, quantization and adapters (no files, devices or network):
    every layout task=plan ranks passes them when set explicitly (tests/test_plan_rules.py)."""
    check_task(cfg, world_size)
    check_parallel(cfg)
    check_batch(cfg)
    check_quant(cfg)
    check_finetune(cfg)


def validate(cfg: DictConfig, world_size: int, nproc_per_node: int) -> None:
    """Run every rule; the first failure raises UserError."""
    validate_values(cfg)
    check_extras(cfg)
    validate_layout(cfg, world_size)
    if cfg.task.name == "grpo":  # these read their files (prompts, reward functions, the teacher)
        check_rl(cfg)
    if cfg.task.name == "distill":
        check_distill(cfg)
    if cfg.task.name != "plan":
        isa()  # SPEEDLLM_CPU_ISA, where set, names a kernel path this CPU runs
        check_world(cfg, world_size)
        check_paths(cfg)
        check_outputs(cfg)
        if not cfg.task.in_process:
            check_rendezvous(cfg)
            check_device(cfg, nproc_per_node)
        if cfg.task.name == "dryrun":
            check_dryrun(cfg, world_size)
        if cfg.task.name not in ("doctor", "convert", "preprocess"):  # preprocess uses no model
            from speedllm.data.loader import check_vocab

            check_vocab(cfg)
    if cfg.task.inference:
        check_inputs(cfg)


def check_rl(cfg: DictConfig) -> None:
    """task=grpo: the rl settings against each other and the layout, the reward functions, and the prompts (read
    and tokenized here, so a bad record stops the run before any rank starts)."""
    from hydra.utils import get_method

    rl, p = cfg.rl, cfg.parallel
    if rl.group_size < 2:
        raise UserError(f"rl.group_size={rl.group_size}: every advantage would be zero (a reward minus the mean of "
                        "its own group); use rl.group_size >= 2")
    for key in ("prompts_per_step", "max_new_tokens", "ppo_epochs", "mini_batches"):
        if rl[key] < 1:
            raise UserError(f"rl.{key}={rl[key]} must be at least 1")
    for key in ("overlong_buffer", "max_resample"):
        if rl[key] < 0:
            raise UserError(f"rl.{key}={rl[key]} must be >= 0")
    if p.pp > 1 or p.cp > 1:
        raise UserError(f"task=grpo does not run on pipeline stages or context-parallel ranks (parallel.pp={p.pp}, "
                        f"parallel.cp={p.cp}); use parallel.pp=1 and parallel.cp=1 (tp, ep and dp split it)")
    if rl.prompts_per_step % p.dp:
        raise UserError(f"rl.prompts_per_step={rl.prompts_per_step} must be divisible by parallel.dp={p.dp} (each "
                        f"data-parallel rank samples its share); use a multiple of {p.dp}")
    rows = rl.prompts_per_step // p.dp * rl.group_size
    if rows % rl.mini_batches:
        raise UserError(f"rl.mini_batches={rl.mini_batches} must divide the {rows} completions of a rank "
                        f"(rl.prompts_per_step / parallel.dp x rl.group_size)")
    if rl.router_replay and not cfg.model.num_experts:
        raise UserError(f"rl.router_replay=true: model {cfg.model.name} has no experts; leave rl.router_replay unset")
    if cfg.model.num_experts and rl.router_replay is not False and p.tp > 1:
        raise UserError(f"rl.router_replay under parallel.tp={p.tp}: the MoE blocks route sequence shards; set "
                        "rl.router_replay=false or use expert parallelism (parallel.ep) instead of tp")
    if rl.rollout_correction != "none" and rl.old_logprobs != "recompute":
        raise UserError(f"rl.rollout_correction={rl.rollout_correction} weighs the training forward's old "
                        "log-probabilities against the rollout's; add rl.old_logprobs=recompute")
    if rl.overlong_buffer > rl.max_new_tokens:
        raise UserError(f"rl.overlong_buffer={rl.overlong_buffer} exceeds rl.max_new_tokens={rl.max_new_tokens}; "
                        "use a smaller buffer")
    if not rl.rewards:
        raise UserError("task=grpo needs reward functions: rl.rewards=[{_target_: module.fn, weight: 1.0}]")
    for key, i, entry in [("rewards", i, e) for i, e in enumerate(rl.rewards)] + \
            [("tools", i, e) for i, e in enumerate(rl.tools)]:
        if not OmegaConf.is_dict(entry) or "_target_" not in entry:
            raise UserError(f"rl.{key}[{i}]={entry} needs _target_: module.fn"
                            + (" (and optionally weight)" if key == "rewards" else ""))
        try:
            get_method(entry["_target_"])
        except Exception as e:  # hydra wraps import and attribute errors alike
            raise UserError(f"rl.{key}[{i}]._target_={entry['_target_']} cannot be imported "
                            f"({str(e).splitlines()[0]}); name a function module.fn on the Python path") from None
        if key == "rewards" and not _finite(entry.get("weight", 1.0)):
            raise UserError(f"rl.rewards[{i}].weight={entry.get('weight')} must be a finite number")
    if cfg.data.input is None:
        raise UserError("task=grpo needs data.input=<json/jsonl of {prompt, ...} records> (or data=rl_demo)")
    from speedllm.data.prompts import load_prompts
    from speedllm.data.tokenizer import load_tokenizer
    from speedllm.models.rope import max_positions

    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.trust_remote_code)
    if rl.tools and tokenizer.convert_tokens_to_ids("</tool_call>") in (None, tokenizer.unk_token_id):
        raise UserError(f"rl.tools: the tokenizer {cfg.data.tokenizer} has no </tool_call> token to end a call; use a "
                        "Qwen3 tokenizer or leave rl.tools empty")
    load_prompts(cfg.data.input, tokenizer, max_positions(cfg.model) - rl.max_new_tokens, rl.max_new_tokens)
