"""Training state per rank: parameters, gradients and optimizer states of a pipeline stage, and where the
offload puts them (see speedllm.planner.memory).
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from speedllm.parallel.pipeline import stages_of_rank
from speedllm.planner.layout import Layout
from speedllm.planner.tensors import MASTER_BYTES, ModelTensors, local_shape, size


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
    stage_mixes: List[Dict[Tuple[bool, bool], int]] = field(default_factory=list)  # layer_mix of each stage


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
        stage_mix = {}
        sp.stage_mixes.append(stage_mix)
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
            stage_mix[mix] = stage_mix.get(mix, 0) + 1
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


def state_text(device: Tuple[int, int, int], host: Tuple[int, int, int]) -> str:
    """`device: params .. grads .. optimizer .. | host: ...` as task=plan and task=dryrun print them."""
    def part(values):
        return " ".join(f"{name} {size(v)}" for name, v in zip(("params", "grads", "optimizer"), values))

    return f"device: {part(device)} | host: {part(host)}"
