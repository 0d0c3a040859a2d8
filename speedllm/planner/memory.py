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

The model lives by kind of memory: planner.tensors (every tensor and its slice), planner.training (parameters,
gradients, optimizer states), planner.activations (a step's activations and the rank's total), planner.frozen
(teacher / reference, rollout cache, inference weights); their public names stay importable from here.
"""

from speedllm.planner.tensors import (
    MASTER_BYTES,
    GIB,
    UPDATE_TEMPORARIES,
    Tensor,
    ModelTensors,
    config_key,
    model_of_key,
    style_dim,
    tp_dim,
    model_tensors,
    local_shape,
    tp_facts,
    size,
)
from speedllm.planner.training import (
    adamw_state_numel,
    fsdp_degrees,
    muon_facts,
    StageParams,
    rank_params,
    placed,
    placed_state_bytes,
    state_text,
)
from speedllm.planner.activations import (
    Memory,
    saved_bytes_per_element,
    gdn_activation_bytes,
    layer_activation_bytes,
    attention_keys_bytes,
    ring_backward_bytes,
    in_flight,
    loss_bytes,
    rank_memory,
)
from speedllm.planner.frozen import (
    teacher_bytes,
    rollout_cache_bytes,
    inference_weight_bytes,
)

__all__ = [
    "MASTER_BYTES",
    "GIB",
    "UPDATE_TEMPORARIES",
    "Tensor",
    "ModelTensors",
    "config_key",
    "model_of_key",
    "style_dim",
    "tp_dim",
    "model_tensors",
    "local_shape",
    "tp_facts",
    "size",
    "adamw_state_numel",
    "fsdp_degrees",
    "muon_facts",
    "StageParams",
    "rank_params",
    "placed",
    "placed_state_bytes",
    "state_text",
    "Memory",
    "saved_bytes_per_element",
    "gdn_activation_bytes",
    "layer_activation_bytes",
    "attention_keys_bytes",
    "ring_backward_bytes",
    "in_flight",
    "loss_bytes",
    "rank_memory",
    "teacher_bytes",
    "rollout_cache_bytes",
    "inference_weight_bytes",
]
