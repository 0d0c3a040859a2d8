"""Layout rules: the task, optimizer, parallel layout, batch, quantization and adapters (no files, devices or
network); a task's own layout rules come from its SPEC (speedllm.planner.spec). Every layout task=plan ranks passes
them when set explicitly (tests/test_plan_rules.py).
"""

from omegaconf import DictConfig

from speedllm.config.values import LORA_TARGETS
from speedllm.errors import UserError
from speedllm.parallel.rules import (
    batch_errors,
    compile_errors,
    layout_errors,
    offload_errors,
    optimizer_layout_errors,
    pipeline_batch_errors,
    qlora_layout_errors,
    sequence_errors,
)
from speedllm.planner.layout import layout_from_config
from speedllm.quant import FLOAT8_RECIPES, TRAINING
from speedllm.tasks import task_spec


def check_parallel(cfg: DictConfig) -> None:
    """The model under the layout, the training levers, and the task's own layout rules (its SPEC)."""
    p, spec = cfg.parallel, task_spec(cfg.task.name)
    errors = layout_errors(cfg.model, tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, cp=p.cp, dp=p.dp,
                           schedule=p.pp_schedule, pp_layers=p.pp_layers, cp_mode=p.cp_mode,
                           cp_ulysses=p.cp_ulysses, sequence_parallel=p.sequence_parallel or cfg.task.inference)
    if not cfg.task.inference:
        errors += offload_errors(p.offload, fsdp=p.fsdp, finetune=cfg.finetune.name, optimizer=cfg.optim._target_)
        errors += compile_errors(compile_=cfg.train.compile, pp=p.pp, schedule=p.pp_schedule)
    errors += spec.layout_errors(cfg, layout_from_config(p, cfg.train), spec.frozen_model(cfg))
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
    """The train.* batch and sequence under the layout, for the tasks that step over them (TaskSpec.train_batches)."""
    t, p = cfg.train, cfg.parallel
    if not task_spec(cfg.task.name).train_batches:
        return
    errors = batch_errors(global_batch=t.global_batch_size, micro_batch=t.micro_batch_size, dp=p.dp)
    errors += pipeline_batch_errors(pp=p.pp, vpp=p.vpp, schedule=p.pp_schedule, pp_microbatches=p.pp_microbatches,
                                    global_batch=t.global_batch_size, micro_batch=t.micro_batch_size, dp=p.dp)
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
    """finetune=lora|qlora settings and a PEFT adapter to start from."""
    ft = cfg.finetune
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


def validate_layout(cfg: DictConfig, world_size: int) -> None:
    """The rules on the task, optimizer, layout, batch, quantization and adapters (no files, devices or network):
    every layout task=plan ranks passes them when set explicitly (tests/test_plan_rules.py)."""
    check_task(cfg, world_size)
    check_parallel(cfg)
    check_batch(cfg)
    check_quant(cfg)
    check_finetune(cfg)
