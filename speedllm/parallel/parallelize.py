"""Apply parallelism to a single-device model from the outside, in a fixed order:
pipeline split -> TP/SP -> EP -> CP -> float8 / QAT wrappers -> activation recompute -> torch.compile -> FSDP2,
and return what was built as a value: a `ParallelModel`.

Every step works on the model (or each pipeline stage of it) while it is still on the meta device;
`materialize` then allocates this rank's pieces and fills them with the single-process initial weights.
"""

import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from speedllm.parallel.fsdp import apply_fsdp
from speedllm.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from speedllm.parallel.pipeline import Pipeline

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


@dataclass
class ParallelModel:
    """What `parallelize` built for this rank.

    Attributes:
        module: every parameter this rank holds, named as in the single-device model (for the optimizer,
            checkpoints and gradient clipping). Without pipeline stages it is the model that runs.
        parts: the modules that run and own the parameters: the pipeline stages of this rank, or [module].
        pipeline: the schedule over `parts` (speedllm.parallel.pipeline.Pipeline), or None.
    """

    module: nn.Module
    parts: List[nn.Module] = field(default_factory=list)
    pipeline: Optional["Pipeline"] = None

    def __call__(self, tokens: torch.Tensor, **kwargs):
        """The whole model's forward (evaluation, samples): Qwen3.forward's results on every rank."""
        if self.pipeline is None:
            return self.module(tokens, **kwargs)
        return self.pipeline.forward_only(tokens, **kwargs)

    def train(self, mode: bool = True) -> "ParallelModel":
        self.module.train(mode)
        return self

    def eval(self) -> "ParallelModel":
        return self.train(False)


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


def output_loss_for(dims: ParallelDims) -> Callable:
    """The output projection + loss a layout's model is built with: vocabulary-parallel under TP."""
    if dims.tp > 1:
        from speedllm.parallel.tensor import vocab_parallel_output_loss

        return vocab_parallel_output_loss
    from speedllm.ops.loss import chunked_cross_entropy

    return chunked_cross_entropy


def _parallelize_part(part: nn.Module, dims: ParallelDims, parallel, train, param_dtype: torch.dtype,
                      device: torch.device, quant=None,
                      adapt: Optional[Callable[[nn.Module], None]] = None) -> None:
    """TP/SP, EP, CP, float8/QAT, adapters, recompute, compile and FSDP2 on one model part (the model or a pipeline
    stage)."""
    expert_mesh = None
    if dims.tp > 1:
        from speedllm.parallel.tensor import apply_tp

        apply_tp(part, dims.mesh["tp"], parallel.sequence_parallel)
    if part.cfg.num_experts and dims.ep * dims.tp > 1:  # experts: EP and FSDP over dp x cp x tp
        from speedllm.parallel.expert import apply_ep

        ep_mesh, expert_mesh = dims.expert_meshes()
        if dims.ep > 1:
            apply_ep(part, ep_mesh)
    if dims.cp > 1:
        from speedllm.parallel.context import apply_cp
        from speedllm.parallel.rules import ulysses_degree

        heads = part.cfg.num_attention_heads // dims.tp
        apply_cp(part, dims.mesh["cp"], parallel.cp_mode,
                 ulysses_degree(parallel.cp_mode, dims.cp, parallel.cp_ulysses, heads))
    if quant is not None and quant.name in ("float8", "qat_int4"):
        from speedllm.quant import prepare_for_training

        prepare_for_training(part, quant, device)
    if adapt is not None:
        adapt(part)
    if train.recompute != "none":
        apply_recompute(part, train.recompute)
    if train.compile:
        for layer in part.layers.values():
            layer.compile()
    if train.activation_offload:
        from speedllm.parallel.offload import apply_activation_offload

        apply_activation_offload(part)
    # experts replicated over several ranks (e.g. the tp ranks of `tp2`) need FSDP even where dp x cp is 1, and
    # offload is FSDP2's (a 1-rank mesh in a single process)
    if dims.mesh is not None and (dims.dp * dims.cp > 1 or not parallel.fsdp or parallel.offload != "none" or
                                  expert_mesh is not None and expert_mesh.size() > 1):
        apply_fsdp(part, dims, param_dtype, parallel.fsdp, parallel.reshard_after_forward, expert_mesh,
                   offload_params=parallel.offload == "params")


def parallelize(model: nn.Module, dims: ParallelDims, parallel, train, param_dtype: torch.dtype,
                device: torch.device, quant=None,
                adapt: Optional[Callable[[nn.Module], None]] = None) -> ParallelModel:
    """This rank's share of `model` (still on the meta device), parallelized for its place in the mesh.

    Args:
        dims: degrees and mesh of the job (speedllm.parallel.mesh.ParallelDims).
        parallel: the layout's settings (schema ParallelConfig: schedule, FSDP, sequence parallel, stages).
        train: recompute and compile settings (schema TrainConfig).
        param_dtype: compute dtype of FSDP's mixed precision.
        quant: the quant section (schema QuantConfig): float8 training or QAT wrap the linear layers.
        adapt: applied to each part after TP/EP/CP and quantization, before recompute and FSDP2 (LoRA adapters,
            which follow the tensor-parallel placements and are sharded by FSDP2 with their layer).
    Layout combinations that cannot be built were rejected by validation (speedllm.parallel.rules).
    """
    if dims.pp == 1:
        _parallelize_part(model, dims, parallel, train, param_dtype, device, quant, adapt)
        return ParallelModel(model, [model])
    from speedllm.parallel.pipeline import Pipeline, split_model

    rank_module, stages = split_model(model, parallel, train.seq_len, dims.mesh["pp"].get_local_rank())
    for _, stage in stages:
        _parallelize_part(stage, dims, parallel, train, param_dtype, device, quant, adapt)
        for name, layer in stage.layers.items():
            rank_module.layers[name] = layer  # recompute may have wrapped it
    pipeline = Pipeline(rank_module, stages, parallel, dims.mesh, device)
    return ParallelModel(rank_module, [module for _, module in stages], pipeline)


def materialize(pm: ParallelModel, dims: ParallelDims, device: torch.device, seed: int,
                offload_params: bool = False) -> None:
    """Allocate this rank's parameters on its device (on the host under parallel.offload=params: FSDP2 copies
    them over per unit) and give them the single-process initial weights of `seed` (each rank draws only its own
    shards: speedllm.parallel.weights). Adapters get their own values afterwards
    (speedllm.adapters.lora.init_adapters)."""
    from torch.distributed.fsdp import FSDPModule

    from speedllm.parallel.tensor import shard_embedding_grad
    from speedllm.parallel.weights import init_shards

    for part in pm.parts:
        part.to_empty(device="cpu" if offload_params else device)  # the model has no buffers to keep on device
        part.tie_embeddings()
        if dims.tp > 1 and not isinstance(part, FSDPModule):  # FSDP: its own
            shard_embedding_grad(part)
    if pm.pipeline is not None:
        pm.pipeline.retie()
    init_shards(pm.parts, pm.module.cfg, seed)


def rowwise_norm(grad: torch.Tensor) -> torch.Tensor:
    """L2 norm of a matrix as the norm of its row norms.

    A tied embedding's gradient holds a few large rows (the tokens in the batch, from the embedding side) beside
    ~vocab small ones (the output layer's softmax side). One float32 pass over all of it adds the small squares to
    an accumulator already grown by the large ones, and rounds them away in an order that depends on how the
    matrix is split: fsdp2 and tp2 then depart from one process by ~5e-5 in the norm. Row norms are each summed at
    their own scale, so every layout gets the same value to float32 rounding.
    """
    rows = torch.linalg.vector_norm(grad, dim=1)
    norm = torch.linalg.vector_norm(rows)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def clip_grad_norm(pm: ParallelModel, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (every shard, every pipeline stage), clipped to max_norm when > 0.

    Gradients may live on different meshes (dense: dp x tp, experts: edp x ep), so the norm is taken per
    mesh and combined; a pipeline's copy of tied embeddings counts once.
    """
    model, pipeline = pm.module, pm.pipeline
    params = [p for p in model.parameters() if p.grad is not None]
    skip = set()
    if pipeline is not None and pipeline.tied and model.lm_head is not None:
        skip.add(id(model.lm_head.weight))  # the first stage counts the tied weight
    tied = model.embed_tokens.weight if model.cfg.tie_word_embeddings and model.embed_tokens is not None else None
    if tied is None or tied.grad is None or id(tied) in skip:  # (a last stage's tie is its head's weight)
        tied = None
    else:
        skip.add(id(tied))  # summed by rows below
    by_mesh = defaultdict(list)  # foreach ops need one mesh per call
    for p in params:
        by_mesh[(p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None].append(p)
    norms = []
    for group in by_mesh.values():
        grads = [p.grad for p in group if id(p) not in skip]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if tied is not None:
        norms.append(rowwise_norm(tied.grad))
    if len(norms) == 1 and pipeline is None:
        total = norms[0]  # exactly torch.nn.utils.clip_grad_norm_'s norm
    else:
        squares = torch.stack(norms).float().square().sum()
        if pipeline is not None:
            dist.all_reduce(squares, group=pipeline.group)
        total = squares.sqrt()
    # torch's coefficient, min(1, max_norm / (total + 1e-6)), read with the norm in one host sync; at 1 the
    # multiply is skipped (x * 1.0 == x)
    norm, coef = torch.stack([total, max_norm / (total + 1e-6)]).tolist()
    if max_norm > 0 and math.isfinite(norm) and coef < 1.0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total
