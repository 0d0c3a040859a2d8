"""Tensor + sequence parallelism: DTensor plans as literal dicts from module name to ParallelStyle.

Layout with sequence parallel (SP): between blocks the residual stream is a DTensor sharded on the sequence
dim (Shard(1)); the norms run on their sequence shard; attention and the MLP all-gather it, compute on their
own heads / intermediate columns (Colwise q/k/v, gate/up), and reduce-scatter back (Rowwise o/down).
Without SP the residual stream is replicated and the Rowwise projections all-reduce instead.

A Gated DeltaNet mixer (hybrid models) is split by key heads the same way: its input projections are Colwise (their
rows are grouped by key head: speedllm.models.gated_deltanet), the conv channels, A_log and dt_bias are sharded
with their heads and handed to the per-head part (GatedDeltaRule) as this rank's shards, the gated norm runs on
this rank's heads, and out_proj is Rowwise. Gated attention's q_proj holds each head's query and gate together,
so Colwise splits it by heads as well.

A MoE block under SP runs on each rank's own tokens, like data-parallel ranks would: it takes the local
sequence shard, the router is replicated (its gradient summed over the tensor axis by DTensor), and the experts
are placed by expert parallelism and FSDP over dp x cp x tp (speedllm.parallel.mesh.ParallelDims.expert_meshes),
not split by TP. Its load-balancing statistics are summed over the tensor axis, so the aux loss is the whole
sequences'. Without SP (inference) the block is left whole on every rank and sees every token.

The embedding and the output projection are vocabulary-parallel: each rank holds V/tp rows, and the loss is
a vocab-parallel cross-entropy (max, sum of exponentials and the target logit reduced over the tensor axis),
so no rank ever holds logits over the whole vocabulary.

Letters: N tokens, D hidden, V vocabulary (Vt: this rank's share of it).
"""

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from speedllm.ops import IGNORE_INDEX
from speedllm.ops.loss import ChunkedLinearCrossEntropy
from speedllm.ops.reference import zero_unlabeled_


def root_plan(sequence_parallel: bool) -> dict:
    """Plan for the modules outside the decoder layers (names as in speedllm.models.qwen3.Qwen3)."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        # A DTensor residual stream keeps its global shape, so the model's B, S and RoPE tables stay whole.
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream,
                                        use_local_output=not sequence_parallel),
        # Only used for logits without labels (generation, evaluation of logits); training uses the loss below.
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


class LocalTokensMoE(ParallelStyle):
    """A MoE block (speedllm.models.moe.MoE) on this rank's sequence shard of the residual stream.

    The block sees a plain local tensor (and its share of the token mask), returns its output as the sequence
    shard of the stream again, and its statistics summed over the tensor axis: one all-reduce of 2E+2 numbers.
    The router (`gate`) is replicated; it takes this rank's token rows as a row shard of the whole batch's rows,
    so DTensor sums its weight gradient over the tensor axis. The shapes given to DTensor are the global ones,
    the same on every rank even where the ranks hold different numbers of tokens (a decode step of one token),
    so every rank takes the same collectives.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from speedllm.parallel.context import _SumOverRanks

        specs = []  # (shape, stride) of the stream entering each forward in flight

        def to_local(module, args):
            x_BSD, *rest = args
            specs.append((x_BSD.shape, x_BSD.stride()))
            if rest and rest[0] is not None:  # the token mask [B, S]: keep this rank's columns
                whole = DTensor.from_local(rest[0], device_mesh, [Replicate()], run_check=False)
                rest[0] = whole.redistribute(placements=[Shard(1)]).to_local()
            return (x_BSD.to_local(), *rest)

        def to_stream(module, args, output):
            out_BSD, (assigned_E, prob_mass_E, num_tokens, entropy) = output
            shape, stride = specs.pop()
            out_BSD = DTensor.from_local(out_BSD, device_mesh, [Shard(1)], run_check=False, shape=shape,
                                         stride=stride)
            E = assigned_E.shape[0]
            total = _SumOverRanks.apply(torch.cat([assigned_E, prob_mass_E, num_tokens.reshape(1),
                                                   entropy.reshape(1)]), device_mesh.get_group())
            # copies, not views of `total`: FSDP warns when a layer returns views
            return out_BSD, (total[:E].clone(), total[E:2 * E].clone(), total[2 * E].clone(),
                             total[2 * E + 1].clone())

        def token_rows(linear, inputs, mesh):
            (x_NF,) = inputs
            B, S, _ = specs[-1][0]
            F = x_NF.shape[-1]
            return DTensor.from_local(x_NF, mesh, [Shard(0)], run_check=False, shape=(B * S, F), stride=(F, 1))

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(to_stream)
        replicated = [module.gate]
        if module.shared_expert is not None:  # replicated too, on the rank's own tokens: never routed
            replicated += [module.shared_expert_gate, *module.shared_expert.children()]
        for linear in replicated:  # parameters replicated
            distribute_module(linear, device_mesh, input_fn=token_rows, output_fn=lambda m, out, mesh: out.to_local())
        return module


class ShardedHeads(ParallelStyle):
    """A Gated DeltaNet mixer's own per-head parameters (A_log, dt_bias; the conv's weight on `conv1d`) sharded on
    dim 0 with their heads; on the mixer itself, its input gathered from the stream to a whole local tensor too."""

    def __init__(self, stream=None):
        self.prepare = None if stream is None else PrepareModuleInput(
            input_layouts=(stream, None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None), use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]),
                                                         param.requires_grad))
        return self.prepare._apply(module, device_mesh) if self.prepare else module


class HeadsNorm(SequenceParallel):
    """A norm over each head of inputs that hold this rank's heads (dim 2), every tensor input (the gated norm's o
    and z) taken as such: its replicated weight's gradient is summed over the tensor axis."""

    def __init__(self):
        super().__init__(sequence_dim=2, use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, sequence_sharding, run_check=False) for x in inputs)


def linear_attention_plan(stream, sequence_parallel: bool, fused: bool) -> dict:
    """Plan for a Gated DeltaNet mixer (speedllm.models.gated_deltanet), split by key heads."""
    projections = ("in_proj_qkvz", "in_proj_ba") if fused else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    # GatedDeltaRule(qkv, b, a, conv weight, A_log, dt_bias, cache, document ids, cu_seqlens): the parameters
    # enter as this rank's shards
    heads = (None, None, None, Shard(0), Shard(0), Shard(0), None, None, None)
    return {
        "linear_attn": ShardedHeads(stream),
        **{f"linear_attn.{name}": ColwiseParallel() for name in projections},
        "linear_attn.conv1d": ShardedHeads(),
        "linear_attn.rule": PrepareModuleInput(input_layouts=heads, desired_input_layouts=heads,
                                               use_local_output=True),
        "linear_attn.norm": HeadsNorm(),
        "linear_attn.out_proj": RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel),
    }


def attention_plan(stream, sequence_parallel: bool) -> dict:
    """Plan for a softmax attention mixer (Qwen3's, or the hybrid family's gated one)."""
    return {
        # Attention.forward(x, cos, sin, mask, kv_cache, attend=None): only x is a distributed activation.
        "self_attn": PrepareModuleInput(input_layouts=(stream, None, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None, None)),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        # q/k norms see only this rank's heads: their weight gradient is a partial sum over the tensor axis,
        # which SequenceParallel over the head dim reduces (without it the forward matches, the gradient not).
        "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.o_proj": RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel),
    }


def layer_plan(sequence_parallel: bool, moe: bool = False, linear: Optional[bool] = None) -> dict:
    """Plan for one decoder layer (mixer, SwiGLU MLP or MoE block, norms). `linear`: None for an attention
    mixer; for a Gated DeltaNet one whether its input projections are fused (Qwen3-Next's)."""
    stream = Shard(1) if sequence_parallel else Replicate()
    if linear is None:
        plan = attention_plan(stream, sequence_parallel)
    else:
        plan = linear_attention_plan(stream, sequence_parallel, linear)
    if moe and sequence_parallel:
        plan["mlp"] = LocalTokensMoE()
    elif not moe:
        plan.update({
            "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel),
        })
    if sequence_parallel:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
    return plan


def _vocab_parallel_chunk(logits, labels_N, vocab_start, group):
    """Summed cross-entropy of one chunk's local fp32 logits and d(sum)/d(local logits), computed in the
    logits' storage, reducing over `group`."""
    local_labels = labels_N - vocab_start
    mine = (local_labels >= 0) & (local_labels < logits.shape[1])
    local_labels = local_labels.clamp(0, logits.shape[1] - 1)[:, None]
    picked_N = logits.gather(1, local_labels).squeeze(1) * mine  # the target logit, on the rank holding it
    max_N = logits.amax(dim=1)
    dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
    probs = logits.sub_(max_N[:, None]).exp_()  # logits' storage becomes the softmax, then the gradient
    sums = torch.stack([probs.sum(dim=1), picked_N])
    dist.all_reduce(sums, group=group)
    keep = labels_N != IGNORE_INDEX
    loss = ((sums[0].log() + max_N - sums[1]) * keep).sum()
    probs.div_(sums[0][:, None])
    probs.scatter_add_(1, local_labels, -mine.float()[:, None])
    return loss, zero_unlabeled_(probs, keep)


def vocab_parallel_output_loss(hidden_ND, weight_VD, labels_N, chunk_size, ops=None):
    """Drop-in for speedllm.ops.loss.chunked_cross_entropy with a vocabulary-sharded output weight.

    hidden_ND may be a DTensor (sequence-sharded or replicated); weight_VD is a DTensor Shard(0) on a 1-D
    tensor-parallel mesh. Each rank projects onto its vocabulary rows, so its gradient with respect to the
    hidden states is a partial sum, which DTensor reduces on the way back. The op set (`ops`) is unused: the
    reductions over the vocabulary are the point of this function.
    """
    hidden, weight, vocab_start, group = vocab_parallel_operands(hidden_ND, weight_VD)
    chunk_fn = partial(_vocab_parallel_chunk, vocab_start=vocab_start, group=group)
    return ChunkedLinearCrossEntropy.apply(hidden, weight, labels_N, chunk_size, chunk_fn)


def vocab_parallel_operands(hidden_ND, weight_VD: DTensor) -> tuple:
    """(hidden states, weight rows, first vocabulary row, tensor-parallel group) of this rank for a projection onto
    its vocabulary rows: the hidden states replicated (from sequence-sharded or replicated), as a local tensor whose
    gradient is a partial sum, which DTensor reduces on the way back; the weight's local Shard(0) rows."""
    mesh = weight_VD.device_mesh
    if isinstance(hidden_ND, DTensor):
        hidden_ND = hidden_ND.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
    else:
        hidden_ND = DTensor.from_local(hidden_ND, mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    _, offset = compute_local_shape_and_global_offset(weight_VD.shape, mesh, weight_VD.placements)
    return hidden_ND, weight_VD.to_local(), offset[0], mesh.get_group()


def _shard_grad_like_param(param: DTensor) -> None:
    if param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(placements=param.placements)


def shard_embedding_grad(model: nn.Module) -> None:
    """DTensor's embedding backward returns a replicated (whole-vocabulary) gradient: keep only our rows.

    Call after the parameters are materialized (hooks live on the parameter objects).
    """
    if model.embed_tokens is not None and model.embed_tokens.weight.requires_grad:  # LoRA freezes it
        model.embed_tokens.weight.register_post_accumulate_grad_hook(_shard_grad_like_param)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model` (a Qwen3, possibly one pipeline stage of it) over the 1-D tensor-parallel mesh in place.

    Training needs the model built with `output_loss=vocab_parallel_output_loss` (speedllm.parallel.output_loss_for).
    """
    plan = {name: style for name, style in root_plan(sequence_parallel).items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, plan)
    model.tie_embeddings()  # distributed separately above; one tensor again
    for layer in model.layers.values():
        linear = layer.linear_attn.fused if layer.is_linear else None
        parallelize_module(layer, tp_mesh, layer_plan(sequence_parallel, layer.is_moe, linear))


def quantize_tp_linear(linear: nn.Linear, quantize) -> nn.Module:
    """The quantized layer that replaces a tensor-parallel nn.Linear of an inference model (no sequence
    parallel), made from this rank's shard alone: `quantize(plain nn.Linear, group)` quantizes it as without TP,
    `group` being the tensor-parallel group for a row-parallel shard (whose int8 row scales span the ranks) and
    None for a column-parallel one. The new module is local-tensor TP in place of the DTensor hooks:

    - colwise (weight Shard(0): q/k/v, gate/up) takes the replicated input as a plain tensor and returns its
      own output features, as ColwiseParallel's local output;
    - rowwise (weight Shard(1): o/down) takes its own input features and returns the partial product summed
      over the tensor axis, the all-reduce RowwiseParallel does without sequence parallel.
    """
    weight = linear.weight
    group = weight.device_mesh.get_group()
    rowwise = weight.placements[0] == Shard(1)
    shard_OD = weight.to_local()
    local = nn.Linear(shard_OD.shape[1], shard_OD.shape[0], bias=False, device="meta")
    local.weight = nn.Parameter(shard_OD, requires_grad=False)
    module = quantize(local, group if rowwise else None)
    module.register_forward_pre_hook(lambda m, args: tuple(a.to_local() if isinstance(a, DTensor) else a
                                                           for a in args))
    if rowwise:
        def sum_over_tp(m, args, out):
            dist.all_reduce(out, group=group)
            return out

        module.register_forward_hook(sum_over_tp)
    return module
