"""Memory of the models a task holds but does not train, and of what it generates: a distillation teacher or
reference model, GRPO's rollout KV cache, inference weights.
"""

import math
from dataclasses import replace
from typing import Tuple

from speedllm.hardware import DTYPES
from speedllm.models.config import PROJECTIONS
from speedllm.models.kv_cache import cache_bytes
from speedllm.planner.layout import Layout
from speedllm.planner.tensors import MASTER_BYTES, local_shape, model_tensors
from speedllm.planner.training import fsdp_degrees, rank_params


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
