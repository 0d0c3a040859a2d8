"""Memory per rank of a training layout: parameters, gradients, optimizer states, activations, buffers.

Parameter, gradient and optimizer bytes are exact: every tensor's shape comes from the real Qwen3 built on the
meta device, and its per-rank slice from the real placements (the tensor-parallel plan of
speedllm.parallel.tensor, experts split over ep on dim 0, FSDP2 sharding dim 0 over its mesh axis, the
pipeline's stage split). Slices follow torch.chunk, as DTensor and FSDP2 do: the first rank of an axis holds
ceil(n / k) rows, the most of any rank, so the numbers below are those of the first rank of each stage.

Activations follow what this code base saves for backward (per op set, SDPA that keeps no score matrix, the
chunked loss), per decoder layer and micro-batch, times the micro-batches a pipeline schedule keeps in flight.
Checked against measurements in tests/test_planner*.py (see BENCHMARKS.md, "Planner").

Letters: N tokens of one micro-batch on one rank, h hidden, q/kv query/key-value width (heads x head_dim),
i MLP width, E experts, k experts per token, e bytes of the compute dtype.
"""

import math
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from torch import nn

from speedllm.hardware import DTYPES
from speedllm.models.config import PROJECTIONS
from speedllm.models.kv_cache import cache_bytes
from speedllm.ops.loss import chunk_rows
from speedllm.parallel.fsdp import expert_shard_dim
from speedllm.parallel.pipeline import stages_of_rank
from speedllm.parallel.rules import ulysses_degree
from speedllm.planner.layout import Layout
from speedllm.train.optimizer import fused_adamw, muon_param_groups

MASTER_BYTES = 4  # fp32 master weights and fp32 gradient reduction (the mixed-precision policy)
GIB = 2**30
UPDATE_TEMPORARIES = 0.8  # foreach AdamW's intermediate tensors, in units of the fp32 parameters (fused: none)


@dataclass(frozen=True)
class Tensor:
    """One parameter of the meta model: its name inside a layer (or at the root), shape and placement facts."""

    name: str
    shape: Tuple[int, ...]
    tp_dim: Optional[int]  # dimension the tensor-parallel plan shards, None = replicated over tp
    expert: bool  # stacked experts [E, out, in], split over ep on dim 0
    muon: bool = False  # a hidden matrix optim=muon updates (speedllm.train.optimizer.muon_param_groups)


@dataclass(frozen=True)
class ModelTensors:
    """The parameters of a Qwen3, grouped so that a layout is costed without walking every layer."""

    layer_kinds: Tuple[Tuple[Tensor, ...], ...]  # distinct decoder-layer parameter sets
    layer_kind: Tuple[int, ...]  # layer id -> index into layer_kinds
    embed: Tuple[Tensor, ...]  # first stage
    head: Tuple[Tensor, ...]  # last stage: final norm, and lm_head unless tied
    tied: bool
    moe_layers: Tuple[bool, ...]
    linear_layers: Tuple[bool, ...]  # Gated DeltaNet mixers (hybrid models)


def config_key(model_cfg) -> tuple:
    """A model config as a hashable key (lists as tuples, a dict such as rope_scaling as its sorted items);
    model_of_key turns it back."""
    items = OmegaConf.to_container(model_cfg, resolve=False) if OmegaConf.is_config(model_cfg) else vars(model_cfg)

    def frozen(v):
        if isinstance(v, dict):
            return ("<dict>", tuple(sorted((k, frozen(x)) for k, x in v.items())))
        return tuple(v) if isinstance(v, list) else v

    return tuple(sorted((k, frozen(v)) for k, v in items.items() if k != "tokenizer"))


def model_of_key(key: tuple):
    """The model config (DictConfig) of a config_key."""

    def thawed(v):
        return {k: thawed(x) for k, x in v[1]} if isinstance(v, tuple) and v[:1] == ("<dict>",) else v

    return OmegaConf.create({k: thawed(v) for k, v in key})


def style_dim(style, module: nn.Module, param_name: str) -> Optional[int]:
    """The dimension a torch ParallelStyle shards `module.<param_name>` on (None: replicated over tp)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if style is None or isinstance(style, (SequenceParallel, PrepareModuleInput, PrepareModuleOutput)):
        return None
    embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):  # Linear: output features (weight and bias); Embedding: hidden
        return 1 if embedding else 0
    if isinstance(style, RowwiseParallel):  # Linear: input features (bias replicated); Embedding: vocabulary
        return 0 if embedding else (1 if param_name == "weight" else None)
    raise ValueError(f"the planner does not know how {type(style).__name__} places parameters")


def tp_dim(module_fqn: str, module: nn.Module, param_name: str) -> Optional[int]:
    """Sharded dim of a parameter under speedllm.parallel.tensor's plans (looked up by module name)."""
    from speedllm.parallel.tensor import layer_plan, root_plan

    if module_fqn.startswith("layers."):
        plan, local = layer_plan(True), module_fqn.split(".", 2)[2]
    else:
        plan, local = root_plan(True), module_fqn
    style = next((s for pattern, s in plan.items() if fnmatch(local, pattern)), None)
    return style_dim(style, module, param_name)


def model_tensors(model_cfg) -> ModelTensors:
    """Parameters of the real model built on the meta device, with their placements (cached per model config)."""
    return _model_tensors(config_key(model_cfg))


@lru_cache(maxsize=32)
def _model_tensors(key: tuple) -> ModelTensors:
    from speedllm.models.moe import Experts
    from speedllm.models.qwen3 import Qwen3

    cfg = model_of_key(key)
    with torch.device("meta"):
        model = Qwen3(cfg)
    expert_params = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    muon_params = {id(p) for g in muon_param_groups(model, False) if g["muon"] for p in g["params"]}
    per_layer: Dict[int, List[Tensor]] = {}
    embed, head = [], []
    for name, param in model.named_parameters():  # a tied lm_head appears once, as embed_tokens.weight
        module, _, pname = name.rpartition(".")
        entry = Tensor(name, tuple(param.shape), tp_dim(module, model.get_submodule(module), pname),
                       id(param) in expert_params, id(param) in muon_params)
        if name.startswith("layers."):
            _, layer, local = name.split(".", 2)
            per_layer.setdefault(int(layer), []).append(replace(entry, name=local))
        elif name.startswith("embed_tokens."):
            embed.append(entry)
        else:
            head.append(entry)
    kinds: List[Tuple[Tensor, ...]] = []
    layer_kind = []
    for layer in range(cfg.num_hidden_layers):
        params = tuple(per_layer[layer])
        if params not in kinds:
            kinds.append(params)
        layer_kind.append(kinds.index(params))
    moe = tuple(layer.is_moe for layer in model.layers.values())
    linear = tuple(layer.is_linear for layer in model.layers.values())
    return ModelTensors(tuple(kinds), tuple(layer_kind), tuple(embed), tuple(head), cfg.tie_word_embeddings, moe,
                        linear)


def _chunk(n: int, k: int) -> int:
    """Rows the first rank gets when torch.chunk splits n rows k ways."""
    return -(-n // k) if k > 1 else n


def local_shape(t: Tensor, tp: int, ep: int, fsdp: int) -> Tuple[int, ...]:
    """Shape of the first rank's piece of tensor t after TP, EP and then FSDP (dim 0; experts:
    speedllm.parallel.fsdp.expert_shard_dim) sharding."""
    shape = list(t.shape)
    if t.expert and ep > 1:
        shape[0] = _chunk(shape[0], ep)
    if t.tp_dim is not None and tp > 1:
        shape[t.tp_dim] = _chunk(shape[t.tp_dim], tp)
    if fsdp > 1:
        dim = expert_shard_dim(shape[0], fsdp) if t.expert else 0
        shape[dim] = _chunk(shape[dim], fsdp)
    return tuple(shape)


def adamw_state_numel(shape, muon: bool = False) -> int:
    """AdamW's exp_avg and exp_avg_sq (the default optimizer; speedllm.train.optimizer.state_numel in general)."""
    return 2 * math.prod(shape)


def fsdp_degrees(layout: Layout) -> Tuple[int, int]:
    """(dense, expert) FSDP2 shard degrees (speedllm.parallel.fsdp): dense weights over dp x cp (over cp
    alone when parallel.fsdp=false replicates over dp); experts, already split over ep ranks carved out of
    dp x cp x tp (every one of them routes its own tokens; tensor parallel does not split experts), over the
    rest of dp x cp x tp."""
    if not layout.fsdp:
        return layout.cp, 1
    return layout.dp * layout.cp, layout.dp * layout.cp * layout.tp // layout.ep


def _tensors_numel(tensors, layout: Layout, sharded: bool, state_numel=None) -> int:
    """Elements of the first rank's pieces of `tensors` (with `state_numel(shape, muon)`: of their optimizer
    states)."""
    dense, expert = fsdp_degrees(layout) if sharded else (1, 1)
    shapes = ((local_shape(t, layout.tp, layout.ep, expert if t.expert else dense), t.muon) for t in tensors)
    if state_numel is None:
        return sum(math.prod(shape) for shape, _ in shapes)
    return sum(state_numel(shape, muon) for shape, muon in shapes)


def muon_facts(tensors, layout: Layout) -> Tuple[int, int, int]:
    """(elements a rank receives when Muon gathers the updates of `tensors`' Muon matrices in full, elements of
    the largest such full tensor (stacked experts: all of them), FLOPs of one Newton-Schulz iteration over them
    all). speedllm.train.muon gathers every matrix on every rank and orthogonalizes it there."""
    gathered = largest = flops = 0
    for t in tensors:
        if not t.muon:
            continue
        full = math.prod(t.shape)
        gathered += full - _tensors_numel([t], layout, True)
        largest = max(largest, full)
        small, big = sorted(t.shape[-2:])
        matrices = t.shape[0] if len(t.shape) == 3 else 1
        flops += matrices * (4 * small * small * big + 2 * small ** 3)  # X X^T, (A) A, (B) X
    return gathered, largest, flops


@dataclass
class StageParams:
    """Parameter elements one pipeline rank holds: sharded (what it stores) and gathered (what FSDP2 all-gathers
    for compute), plus the largest single layer gathered."""

    sharded: int = 0
    optimizer_state: int = 0  # elements of the optimizer's per-parameter state over the sharded pieces
    gathered: int = 0
    root_gathered: int = 0  # embedding / final norm / lm_head: the root FSDP unit, kept through the step
    max_layer_gathered: int = 0
    max_layer_sharded: int = 0
    max_tensor_state: int = 0  # optimizer state elements of the largest single parameter piece
    muon_gathered: int = 0  # optim=muon: elements of the updates a step gathers (muon_facts)
    muon_largest: int = 0
    muon_flops: int = 0  # of one Newton-Schulz iteration over every Muon matrix of this rank
    layers: int = 0
    moe_layers: int = 0
    # layers by (Gated DeltaNet mixer, MoE MLP): what their activations depend on
    layer_mix: Dict[Tuple[bool, bool], int] = field(default_factory=dict)
    has_embed: bool = False
    has_head: bool = False
    per_stage_layers: List[int] = field(default_factory=list)


def rank_params(mt: ModelTensors, layout: Layout, layer_split: List[int], pp_rank: int,
                state_numel=adamw_state_numel) -> StageParams:
    """What pipeline rank `pp_rank` holds under `layout`, given the layers per stage (pp * vpp stages).

    Args:
        state_numel: optimizer state elements kept for a parameter piece of a given shape, `(shape, muon)` with
            muon whether optim=muon updates it with Muon (speedllm.train.optimizer.state_numel).
    """
    sp = StageParams()
    starts = [sum(layer_split[:i]) for i in range(len(layer_split))]
    last = len(layer_split) - 1
    kind_sharded = [_tensors_numel(kind, layout, True) for kind in mt.layer_kinds]
    kind_state = [_tensors_numel(kind, layout, True, state_numel) for kind in mt.layer_kinds]
    kind_gathered = [_tensors_numel(kind, layout, False) for kind in mt.layer_kinds]
    kind_max_state = [max(_tensors_numel([t], layout, True, state_numel) for t in kind) for kind in mt.layer_kinds]
    kind_muon = [muon_facts(kind, layout) for kind in mt.layer_kinds]
    for stage in stages_of_rank(pp_rank, layout.pp, layout.vpp, layout.schedule):
        layers = range(starts[stage], starts[stage] + layer_split[stage])
        sp.per_stage_layers.append(len(layers))
        for layer in layers:
            kind = mt.layer_kind[layer]
            sp.sharded += kind_sharded[kind]
            sp.optimizer_state += kind_state[kind]
            gathered = kind_gathered[kind]
            sp.gathered += gathered
            sp.max_layer_gathered = max(sp.max_layer_gathered, gathered)
            sp.max_layer_sharded = max(sp.max_layer_sharded, kind_sharded[kind])
            sp.max_tensor_state = max(sp.max_tensor_state, kind_max_state[kind])
            gathered, largest, flops = kind_muon[kind]
            sp.muon_gathered += gathered
            sp.muon_largest = max(sp.muon_largest, largest)
            sp.muon_flops += flops
            sp.layers += 1
            sp.moe_layers += mt.moe_layers[layer]
            mix = (mt.linear_layers[layer], mt.moe_layers[layer])
            sp.layer_mix[mix] = sp.layer_mix.get(mix, 0) + 1
        root = []
        if stage == 0:
            root += mt.embed
            sp.has_embed = True
        if stage == last:
            root += mt.head
            # With tied embeddings the last stage keeps its own copy of the table unless it is also the first.
            if mt.tied and stage != 0:
                root += mt.embed
            sp.has_head = True
        sp.sharded += _tensors_numel(root, layout, True)
        sp.optimizer_state += _tensors_numel(root, layout, True, state_numel)
        sp.max_tensor_state = max([sp.max_tensor_state] + [_tensors_numel([t], layout, True, state_numel)
                                                            for t in root])
        root_gathered = _tensors_numel(root, layout, False)
        sp.gathered += root_gathered
        sp.root_gathered += root_gathered
    return sp


def placed(state: Tuple[int, int, int], offload: str) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """(device, host) split of a rank's (parameter, gradient, optimizer state) bytes under parallel.offload:
    params keeps all three in host memory (FSDP2's CPUOffloadPolicy), optimizer the states
    (speedllm.parallel.offload)."""
    params, grads, optimizer = state
    if offload == "params":
        return (0, 0, 0), (params, grads, optimizer)
    if offload == "optimizer":
        return (params, grads, 0), (0, 0, optimizer)
    return (params, grads, optimizer), (0, 0, 0)


def placed_state_bytes(sp: StageParams, offload: str) -> Tuple[Tuple[int, int, int], Tuple[int, int, int]]:
    """The planner's (device, host) bytes of a rank's fp32 parameters, gradients and optimizer states."""
    return placed((sp.sharded * MASTER_BYTES, sp.sharded * MASTER_BYTES, sp.optimizer_state * MASTER_BYTES), offload)


def size(num_bytes: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB, with 3 decimals."""
    return f"{num_bytes / GIB:.3f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.3f} MiB"


def state_text(device: Tuple[int, int, int], host: Tuple[int, int, int]) -> str:
    """`device: params .. grads .. optimizer .. | host: ...` as task=plan and task=dryrun print them."""
    def part(values):
        return " ".join(f"{name} {size(v)}" for name, v in zip(("params", "grads", "optimizer"), values))

    return f"device: {part(device)} | host: {part(host)}"


@dataclass
class Memory:
    """Bytes per device of one pipeline rank, by component, and the peak over a step's two phases; what
    parallel.offload and train.activation_offload move to host memory is in `host` instead.

    Forward/backward holds the weights, optimizer states, activations and buffers, plus gradients only while
    they accumulate over micro-batches (the loop frees a step's gradients after the update); the optimizer
    update holds weights, gradients, states and the update's temporaries.
    """

    params: float = 0.0
    grads: float = 0.0  # this rank's (sharded) gradients, alive from the end of backward to the update
    grad_accum: float = 0.0  # gradients accumulating over micro-batches, alive through forward and backward
    optimizer: float = 0.0
    activations: float = 0.0
    # activations alive once gradients exist (a pipeline rank has run one backward by then)
    activations_with_grads: float = 0.0
    buffers: float = 0.0  # FSDP2 all-gathered weights, autocast weight copies, pipeline send/receive
    update_temporaries: float = 0.0
    pp_rank: int = 0
    # host memory of this rank (parallel.offload, train.activation_offload): not part of the device peak
    host: float = 0.0
    host_activations: float = 0.0  # of `host`: saved activations at their peak
    offloaded_per_layer: float = 0.0  # activation bytes one layer sends to the host per micro-batch
    teacher: float = 0.0  # a frozen model's weights on this rank (teacher_bytes): distill's teacher, grpo's reference
    rollout: float = 0.0  # task=grpo: the sampling KV cache of this rank's completions (rollout_cache_bytes)

    @property
    def sampling(self) -> float:
        """task=grpo's rollout, before the step's forward: no activations and no gradients yet."""
        return self.params + self.optimizer + self.teacher + self.rollout

    @property
    def forward_backward(self) -> float:
        live = max(self.activations, self.grad_accum + self.activations_with_grads)
        return self.params + self.optimizer + self.buffers + live + self.teacher

    @property
    def update(self) -> float:
        return self.params + self.grads + self.optimizer + self.update_temporaries + self.teacher

    @property
    def total(self) -> float:
        return max(self.forward_backward, self.update, self.sampling)


def saved_bytes_per_element(ops: str, e: int) -> Tuple[int, int, int]:
    """Bytes an op set keeps for backward per element of (an RMSNorm's input, a RoPE input, the MLP width).

    reference: RMSNorm keeps an fp32 copy of its input and its normalized output; RoPE multiplies by constant
    tables and keeps nothing; SwiGLU keeps gate, up, silu(gate) and the product. cuda: torch's fused rms_norm
    keeps its input, the rest is eager. npu: npu_rms_norm and npu_rotary_mul keep their input, npu_swiglu the
    concatenated gate/up and its output. cpu: the fused RMSNorm keeps its input (and 4 bytes a row), RoPE nothing,
    SwiGLU gate and up (the product is kept by down_proj).
    """
    if ops == "npu":
        return e, e, 3 * e
    if ops == "cpu":
        return e, 0, 3 * e
    if ops == "cuda":
        return e, 0, 4 * e
    return 4 + e, 0, 4 * e


def gdn_activation_bytes(m, e: int, norm_b: int) -> float:
    """Bytes a Gated DeltaNet mixer saves per token for backward (no recompute; speedllm.models.gated_deltanet,
    the chunked gated delta rule of speedllm.ops): the projections' outputs (q, k, v channels C, z, a, b), the
    conv's padded input and pre-SiLU output and its SiLU output (the rule's input), the fp32 decay and beta, the
    rule's per-token fp32 work (its UT-transformed keys and values) and its state at each 64-token chunk start,
    the gated norm's fp32 output, gate and product, and out_proj's input. An estimate from the code, not yet held
    against a measurement (tests/test_planner.py measures the attention layer)."""
    hk, hv, k, v = m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    c, vd = 2 * hk * k + hv * v, hv * v
    proj = e * (c + vd + 2 * hv)
    conv = 3 * e * c
    rule = 4 * 2 * hv + 4 * hv * (k + v) + 4 * hv * k * v / 64
    gate = norm_b * vd + 3 * 4 * vd + e * vd
    return proj + conv + rule + gate


def layer_activation_bytes(m, layout: Layout, seq_len: int, dtype_bytes: int, moe: bool, tp_dims,
                           ops: str = "reference", linear: bool = False) -> float:
    """Bytes one decoder layer saves for backward for one micro-batch, by recompute policy.

    Args:
        tp_dims: whether the TP plan splits (the MLP width, the experts' width, the vocabulary).
        ops: the hardware profile's op set (what the fused kernels keep differs, see saved_bytes_per_element).
        linear: a Gated DeltaNet mixer instead of attention (hybrid models, which run without tp, cp or sp).
    """
    e, tp = dtype_bytes, layout.tp
    sp = tp if layout.sequence_parallel else 1
    n = layout.micro_batch * seq_len / layout.cp
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d / tp, m.num_key_value_heads * d / tp
    lse = 4 * m.num_attention_heads / tp  # attention's fp32 log-sum-exp per query head
    k_top = m.num_experts_per_tok
    i_moe = m.moe_intermediate_size / (tp if tp_dims[1] else 1)
    i_mlp = m.intermediate_size / (tp if tp_dims[0] else 1)
    if layout.recompute == "full":
        return n * h * e / sp  # the layer input; the rest is rebuilt in backward
    gate = m.attention_output_gate  # q_proj also yields a gate per query: sigmoid(gate) * attention's output
    if layout.recompute == "selective":
        # the layer input and the outputs of matmuls and attention (see speedllm/parallel/parallelize.py)
        attn = e * h / sp + e * (q * (2 if gate else 1) + 2 * kv) + e * q + lse + e * h / sp
        if linear:  # the input and the matmuls' outputs: projections, and out_proj's input
            vd = m.linear_num_value_heads * m.linear_value_head_dim
            attn = 2 * e * h + e * (2 * m.linear_num_key_heads * m.linear_key_head_dim + 2 * vd
                                    + 2 * m.linear_num_value_heads) + e * vd
        # a MoE block under sequence parallel routes only this rank's share of the tokens
        mlp = e * (m.num_experts + k_top * (2 * i_moe + h)) / sp if moe else e * (2 * i_mlp + h / sp)
        return n * (attn + mlp)
    norm_b, rope_b, swiglu_b = saved_bytes_per_element(ops, e)
    # two RMSNorms on the (sequence-parallel) residual stream; the all-gathered input of the projections
    # after each is saved at full size by those projections (a MoE block takes its local tokens ungathered)
    norms = 2 * norm_b * h / sp + e * h + e * h / (sp if moe else 1)
    # q and k: the projection and normed heads (kept by their RMSNorm), RoPE's input, the rotated heads (kept
    # by attention); v; attention's output and the contiguous copy fed to o_proj
    attn = (norm_b + rope_b) * (q + kv) + e * q + attention_keys_bytes(m, layout, e) + 2 * e * q + lse
    if gate:  # the gate, its sigmoid and the product's other input
        attn += 3 * e * q
    if linear:  # instead of attention
        attn = gdn_activation_bytes(m, e, norm_b)
    if moe:
        router = 4 * m.num_experts  # fp32 router probabilities
        # rows sorted by expert, expert outputs; of this rank's share of the tokens under sequence parallel
        mlp = (router + 2 * e * k_top * h + swiglu_b * k_top * i_moe) / sp
    else:
        mlp = swiglu_b * i_mlp
    return n * (norms + attn + mlp)


def attention_keys_bytes(m, layout: Layout, e: int) -> float:
    """Bytes per local token that attention keeps of keys and values (and, for ring attention, of each K/V
    block's partial result), by parallel.cp_mode (speedllm/parallel/context.py).

    allgather keeps the gathered K/V of the whole sequence; ulysses the K/V of all positions for its share
    of the heads (kv heads repeated up to a multiple of cp); ring keeps every block it received and per block
    the fp32 partial output, log-sum-exp and merge weight (the block's scores are recomputed in backward).
    """
    cp, tp = layout.cp, layout.tp
    kv = m.num_key_value_heads * m.head_dim / tp
    if cp == 1:
        return 2 * e * kv
    heads = m.num_attention_heads // tp
    n = ulysses_degree(layout.cp_mode, cp, 0, heads)
    kv_heads = m.num_key_value_heads // tp
    kv *= n // math.gcd(kv_heads, n)  # repeated so the all-to-all splits them
    if layout.cp_mode == "allgather":
        return 2 * e * kv * cp
    if layout.cp_mode == "ulysses":
        return 2 * e * kv
    ring = cp // n
    return ring * (2 * e * kv + 4 * (m.num_attention_heads * m.head_dim / tp + 2 * heads))


def ring_backward_bytes(m, layout: Layout, seq_len: int) -> float:
    """Backward's temporaries of one recomputed ring-attention chunk: fp32 scores, their masked copy,
    probabilities and the gradients of the two (about five [queries x block keys] fp32 matrices per head)."""
    from speedllm.parallel.context import RING_QUERY_CHUNK

    if layout.cp == 1 or layout.cp_mode not in ("ring", "hybrid"):
        return 0.0
    n = ulysses_degree(layout.cp_mode, layout.cp, 0, m.num_attention_heads // layout.tp)
    block = layout.micro_batch * seq_len / (layout.cp // n)  # keys of one ring block (all its heads' share)
    heads = m.num_attention_heads / layout.tp / n
    return 5 * 4 * heads * min(RING_QUERY_CHUNK, block) * block


def in_flight(layout: Layout, pp_rank: int, num_micro: int) -> int:
    """Stage-micro-batches whose activations rank `pp_rank` holds at once under the pipeline schedule."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "GPipe":
        return num_micro * layout.vpp
    warmup = (layout.vpp - 1) * layout.pp + 2 * (layout.pp - 1 - pp_rank) if layout.vpp > 1 \
        else layout.pp - 1 - pp_rank
    return min(warmup + 1, num_micro * layout.vpp)


def loss_bytes(m, layout: Layout, seq_len: int, dtype_bytes: int, chunk: int, vocab_split: int) -> Tuple[float, float]:
    """(saved, transient) bytes of the last stage's norm + chunked output projection and loss for one micro-batch.

    The chunked loss keeps the hidden-state gradient and the weight gradient (fp32 while accumulating) from its
    forward; a chunk's logits live only inside it (logits, fp32 copy, softmax work, their gradient).
    """
    e = dtype_bytes
    n = layout.micro_batch * seq_len / layout.cp
    v = m.vocab_size / vocab_split
    saved = n * m.hidden_size * (4 + 2 * e) + v * m.hidden_size * e
    # a chunk's logits and their gradient (fp32 beside low-precision logits), and the fp32 weight-gradient
    # accumulator when the weight is in low precision
    transient = chunk_rows(chunk, n, v) * v * (4 if e == 4 else 4 + e)
    if e < 4:
        transient += v * m.hidden_size * 4
    return saved, transient


def rank_memory(m, layout: Layout, sp: StageParams, pp_rank: int, seq_len: int,
                global_batch: int, dtype: str, loss_chunk: int, tp_dims, ops: str = "reference",
                device: str = "cuda", muon_bytes: int = 0) -> Memory:
    """Peak bytes of pipeline rank `pp_rank` in a training step.

    Args:
        tp_dims: whether the TP plan splits (the MLP width, the experts' width, the vocabulary), see tp_facts.
        device: the profile's device type, which decides whether AdamW runs fused (speedllm.train.optimizer).
        muon_bytes: optim=muon's Newton-Schulz dtype size (0: another optimizer); its update holds the largest
            gathered matrix, its working copy and the orthogonalized result in that dtype.
    """
    e = DTYPES[dtype].itemsize
    num_micro = global_batch // (layout.micro_batch * layout.dp)
    mem = Memory(pp_rank=pp_rank)
    (mem.params, mem.grads, mem.optimizer), host = placed_state_bytes(sp, layout.offload)
    mem.host = sum(host)
    if layout.offload == "params":  # the update runs on the host (fused AdamW on a CPU: no temporaries)
        mem.update_temporaries = 0.0
    elif layout.offload == "optimizer":  # one parameter's states at a time on the device
        mem.update_temporaries = sp.max_tensor_state * MASTER_BYTES
    else:
        mem.update_temporaries = 0.0 if fused_adamw(device) else sp.sharded * MASTER_BYTES * UPDATE_TEMPORARIES
    mem.update_temporaries += 3 * sp.muon_largest * muon_bytes
    accumulating = num_micro > 1 or layout.pp > 1
    dense_fsdp, _ = fsdp_degrees(layout)
    if layout.fsdp and (dense_fsdp > 1 or layout.offload != "none"):  # offload: FSDP2 on a 1-rank mesh too
        # torch's pipeline schedules keep a stage's weights gathered until its last backward; otherwise FSDP2
        # holds the root unit (embedding, final norm, lm_head) and about one layer gathered at a time
        if layout.pp > 1 or not layout.reshard_after_forward:
            mem.buffers = sp.gathered * e
        else:
            mem.buffers = (sp.root_gathered + sp.max_layer_gathered) * e
        if accumulating:  # without a gradient sync FSDP2 accumulates unsharded, in fp32 (the reduce dtype)
            mem.grad_accum = sp.gathered * MASTER_BYTES
        if layout.offload == "params":  # a unit's fp32 shards are copied to the device before its all-gather
            mem.buffers += sp.max_layer_sharded * MASTER_BYTES
    else:
        if e < MASTER_BYTES:
            mem.buffers = sp.gathered * e  # autocast keeps a low-precision copy of every weight during forward
        if accumulating:
            mem.grad_accum = mem.grads
    flight = in_flight(layout, pp_rank, num_micro)
    max_stage_layers = max(sp.per_stage_layers)
    full = Layout(**{**layout.__dict__, "recompute": "none"})
    act = {(linear, moe): layer_activation_bytes(m, layout, seq_len, e, moe, tp_dims, ops, linear)
           for linear, moe in sp.layer_mix}
    act_full = {(linear, moe): layer_activation_bytes(m, full, seq_len, e, moe, tp_dims, ops, linear)
                for linear, moe in sp.layer_mix}
    # average layer of this rank times the layers of its largest stage
    avg = sum(count * act[mix] for mix, count in sp.layer_mix.items()) / sp.layers
    per_stage_act = avg * max_stage_layers
    # a recomputed layer is rebuilt whole in backward; the loss's chunk logits live only inside its forward
    working = 0.0 if layout.recompute == "none" else max(act_full.values(), default=0.0)
    head = 0.0
    transient = 0.0
    if sp.has_head:
        saved, transient = loss_bytes(m, layout, seq_len, e, loss_chunk, layout.tp if tp_dims[2] else 1)
        # the loss stage runs each micro-batch's backward right after its forward, except under GPipe
        head = saved * (num_micro if layout.pp > 1 and layout.schedule == "GPipe" else 1)
        vocab = m.vocab_size / (layout.tp if tp_dims[2] else 1)
        if working:  # the output projection's gradient is made at the start of backward and kept to the end
            working += vocab * m.hidden_size * MASTER_BYTES
    # ring attention rebuilds one chunk of a block's scores at a time in backward (speedllm.parallel.context)
    transient = max(transient, ring_backward_bytes(m, layout, seq_len))
    flight_with_grads = max(flight - 1, 1) if layout.pp > 1 else flight
    layer_act = per_stage_act / max_stage_layers
    if layout.activation_offload:
        # the decoder layers' saved tensors go to the host (selective recompute: only the layer input, its kept
        # matmul outputs stay in the checkpoint's cache); the device holds the layer being copied out in
        # forward, or the one in use and the one prefetched in backward
        n = layout.micro_batch * seq_len / layout.cp
        moved = n * m.hidden_size * e / (layout.tp if layout.sequence_parallel else 1) \
            if layout.recompute == "selective" else layer_act
        mem.offloaded_per_layer = moved
        mem.host_activations = flight * moved * max_stage_layers
        mem.host += mem.host_activations
        per_stage_act -= moved * max_stage_layers
        in_transit = 2 * moved
    else:
        in_transit = 0.0
    mem.activations = flight * per_stage_act + in_transit + head + max(working, transient)
    # a pipeline rank's gradients appear with its first backward, which frees one micro-batch's activations
    mem.activations_with_grads = flight_with_grads * per_stage_act + in_transit + head + max(working, transient)
    if layout.pp > 1:
        n = layout.micro_batch * seq_len / layout.cp
        mem.buffers += 4 * n * m.hidden_size * e / (layout.tp if layout.sequence_parallel else 1)
    return mem


def teacher_bytes(teacher_cfg, layout: Layout, dtype: str, gathered: bool = True, quant: str = "none",
                  whole: bool = False) -> float:
    """task=distill: a rank's bytes of the frozen teacher (speedllm.train.teacher), built like the student under the
    layout's TP and FSDP2 (no pipeline stages): its fp32 weights, sharded, plus under FSDP2 its root unit
    (embedding, final norm, output projection) gathered in `dtype` while the student's loss reads it. No gradients,
    no optimizer states, and its activations are those of one forward without saved tensors (not counted).
    gathered=False: the weights alone (what task=dryrun finds on a rank). whole (distill.teacher_parallel=replicate)
    or quant=int8_wo (distill.teacher_quant): every rank holds all of it, nothing gathered (speedllm.train.teacher.
    whole_teacher); int8_wo: its dense decoder projections in one byte a weight plus an fp32 scale a row."""
    if whole or quant != "none":
        layout = Layout()
    mt = model_tensors(teacher_cfg)
    sp = rank_params(mt, replace(layout, pp=1, vpp=1), [teacher_cfg.num_hidden_layers], 0)
    dense_fsdp, _ = fsdp_degrees(layout)
    root = sp.root_gathered * DTYPES[dtype].itemsize if gathered and layout.fsdp and dense_fsdp > 1 else 0.0
    saved = 0.0
    if quant == "int8_wo":
        projections = [t.shape for kind in (mt.layer_kinds[k] for k in mt.layer_kind) for t in kind
                       if not t.expert and t.name.rsplit(".", 2)[-2] in PROJECTIONS]
        saved = sum((MASTER_BYTES - 1) * rows * cols - 4 * rows for rows, cols in projections)
    return sp.sharded * MASTER_BYTES + root - saved


def rollout_cache_bytes(m, layout: Layout, rows: int, seq_len: int, dtype: str) -> float:
    """task=grpo: a rank's KV cache while it samples: its data-parallel share of `rows` completions (prompts per
    step x group size), each up to `seq_len` tokens (prompt and completion), its tensor-parallel share of the kv
    heads, every layer's state (K/V, or a GDN layer's), in `dtype` (speedllm.generation.engine.new_cache)."""
    return cache_bytes(m, math.ceil(rows / layout.dp), seq_len, DTYPES[dtype].itemsize, layout.tp)


def inference_weight_bytes(model_cfg, quant, dtype: str, tp: int = 1) -> Tuple[float, float]:
    """(bytes of one tensor-parallel rank's weights for inference under `quant`, the same in `dtype`,
    unquantized); tp=1: the whole model.

    The projections quantization applies to (speedllm.quant.QUANTIZED) take bytes_per_weight of their scheme,
    on their 1/tp shard; the weight-only schemes keep the embedding and output projection in int8
    (speedllm.quant.int8_tables), whole on every rank (speedllm.generation.load.load_quantized); norms, router and
    experts stay in the compute dtype.
    """
    from speedllm.quant import QUANTIZED, bytes_per_weight, int8_tables

    mt = model_tensors(model_cfg)
    e = DTYPES[dtype].itemsize
    per_weight = bytes_per_weight(quant.name, e, quant.group_size)
    total = plain = 0.0
    tensors = [t for kind in mt.layer_kind for t in mt.layer_kinds[kind]] + list(mt.embed) + list(mt.head)
    for t in tensors:
        numel = math.prod(local_shape(t, tp, 1, 1))
        module = t.name.rsplit(".", 2)[-2]
        if int8_tables(quant.name) and module in ("embed_tokens", "lm_head"):
            total += math.prod(t.shape) * 1.0
        else:
            total += numel * (per_weight if not t.expert and module in QUANTIZED else e)
        plain += numel * e
    return total, plain


def tp_facts(mt: ModelTensors) -> Tuple[bool, bool, bool]:
    """Whether the TP plan splits the dense MLP width, the experts' width and the vocabulary."""
    layer_tensors = [t for kind in mt.layer_kinds for t in kind]
    mlp = any(t.name == "mlp.gate_proj.weight" and t.tp_dim is not None for t in layer_tensors)
    experts = any(t.expert and t.tp_dim is not None for t in layer_tensors)
    vocab = any(t.tp_dim == 0 for t in mt.embed)
    return mlp, experts, vocab
