"""Apply parallelism to a single-device model from the outside, in a fixed order:
pipeline split -> TP/SP -> EP -> CP -> activation recompute -> torch.compile -> FSDP2.

Every step works on the model (or each pipeline stage of it) while it is still on the meta device;
`materialize` then allocates this rank's pieces and fills them with the single-process initial weights.
"""

import math
from collections import defaultdict
from functools import partial

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor

from speedllm.errors import UserError
from speedllm.parallel.fsdp import apply_fsdp
from speedllm.parallel.mesh import data_mesh, expert_meshes

# Ops whose outputs selective recompute keeps: the matmuls and attention are the expensive ones to redo;
# norms, activations and elementwise ops are cheap to recompute and their outputs are the bulk of memory.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: nn.Module, mode: str) -> None:
    """Wrap every decoder layer: `full` recomputes the whole layer in backward, `selective` only cheap ops."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    for name, layer in model.layers.named_children():
        if mode == "full":
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(layer, preserve_rng_state=False,
                                         context_fn=partial(create_selective_checkpoint_contexts, _selective_policy))
        model.layers.register_module(name, wrapped)


def _parallelize_part(part: nn.Module, cfg: DictConfig, rt) -> None:
    """TP/SP, EP, CP, recompute, compile and FSDP2 on one model part (the model or a pipeline stage)."""
    p = cfg.parallel
    expert_mesh = None
    if rt.mesh is not None and p.tp > 1:
        from speedllm.parallel.tensor import apply_tp

        apply_tp(part, rt.mesh["tp"], p.sequence_parallel)
    if rt.mesh is not None and p.ep > 1:
        from speedllm.parallel.expert import apply_ep

        ep_mesh, expert_mesh = expert_meshes(rt.mesh, p.ep)
        apply_ep(part, ep_mesh)
    if rt.mesh is not None and p.cp > 1:
        from speedllm.parallel.context import apply_cp

        apply_cp(part, rt.mesh["cp"])
    if cfg.finetune.name != "full":
        from speedllm.finetune.lora import apply_lora

        ft = cfg.finetune
        apply_lora(part, ft.rank, ft.alpha, ft.dropout, ft.targets)
    if cfg.train.recompute != "none":
        apply_recompute(part, cfg.train.recompute)
    if cfg.train.compile:
        for layer in part.layers.values():
            layer.compile()
    if rt.mesh is not None and (data_mesh(rt.mesh).size() > 1 or not p.fsdp):
        apply_fsdp(part, cfg, rt.mesh, expert_mesh)


def parallelize(model: nn.Module, cfg: DictConfig, rt) -> nn.Module:
    """Return `model` (still on the meta device) prepared for this rank's place in the mesh.

    With pipeline parallelism the result holds only this rank's layers and carries a `pipeline`
    (speedllm.parallel.pipeline.Pipeline) whose forward_backward the training loop uses.
    """
    p = cfg.parallel
    if p.cp > 1 and (p.pp > 1 or cfg.model.num_experts > 0):
        raise UserError(f"parallel.cp={p.cp} works with dense models without pipeline stages; set parallel.cp=1 "
                        f"or use parallel.pp=1 and a dense model")
    if p.tp > 1 and cfg.model.num_experts > 0:
        raise UserError(f"parallel.tp={p.tp} with MoE model {cfg.model.name} is not supported; use parallel.ep "
                        f"for the experts and parallel.tp=1")
    if rt.mesh is None or p.pp == 1:
        _parallelize_part(model, cfg, rt)
        return model
    if cfg.model.num_experts > 0:
        raise UserError(f"parallel.pp={p.pp} with MoE model {cfg.model.name} is not supported (the load-balancing "
                        "loss spans all layers); use parallel.pp=1")
    from speedllm.parallel.pipeline import Pipeline, split_model

    rank_module, stages = split_model(model, cfg, rt.mesh["pp"].get_local_rank())
    for _, stage in stages:
        _parallelize_part(stage, cfg, rt)
        for name, layer in stage.layers.items():
            rank_module.layers[name] = layer  # recompute may have wrapped it
    rank_module.pipeline = Pipeline(rank_module, stages, cfg, rt.mesh, rt.device)
    # called as a whole model (evaluation, samples), this rank's module runs the stages in turn
    rank_module.forward = rank_module.pipeline.forward_only
    return rank_module


def model_parts(model: nn.Module) -> list:
    """The modules that own this rank's parameters: the pipeline stages, or the model itself."""
    pipeline = getattr(model, "pipeline", None)
    return pipeline.modules if pipeline is not None else [model]


def materialize(model: nn.Module, cfg: DictConfig, rt) -> None:
    """Allocate this rank's parameters on its device and give them the single-process initial weights."""
    from torch.distributed.fsdp import FSDPModule

    from speedllm.parallel.tensor import shard_embedding_grad
    from speedllm.parallel.weights import init_from_rank0, tie_embeddings

    parts = model_parts(model)
    for part in parts:
        part.to_empty(device=rt.device)
        tie_embeddings(part)
        if rt.mesh is not None and cfg.parallel.tp > 1 and not isinstance(part, FSDPModule):  # FSDP: its own
            shard_embedding_grad(part)
    if getattr(model, "pipeline", None) is not None:
        model.pipeline.retie()
    # (init_weights on a model holding LoRA adapters would draw their values between the base's: not the base a
    # model without them gets)
    if rt.world_size == 1 and rt.device.type == "cpu" and cfg.finetune.name == "full":
        with torch.no_grad():
            model.init_weights()
    else:  # initialized in host memory (the same RNG stream on every layout and device), then placed
        init_from_rank0(parts, cfg, rt.device)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (every shard, every pipeline stage), clipped to max_norm when > 0.

    Gradients may live on different meshes (dense: dp x tp, experts: edp x ep), so the norm is taken per
    mesh and combined; a pipeline's copy of tied embeddings counts once.
    """
    pipeline = getattr(model, "pipeline", None)
    params = [p for p in model.parameters() if p.grad is not None]
    skip = set()
    if pipeline is not None and pipeline.tied and model.lm_head is not None:
        skip.add(id(model.lm_head.weight))  # the first stage counts the tied weight
    by_mesh = defaultdict(list)  # foreach ops need one mesh per call
    for p in params:
        by_mesh[(p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for group in by_mesh.values():
        grads = [p.grad for p in group if id(p) not in skip]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1 and pipeline is None:
        total = norms[0]  # exactly torch.nn.utils.clip_grad_norm_'s norm
    else:
        squares = torch.stack(norms).float().square().sum()
        if pipeline is not None:
            dist.all_reduce(squares, group=pipeline.group)
        total = squares.sqrt()
    if max_norm > 0 and math.isfinite(total.item()):
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
