"""Every tensor of a model from the real Qwen3 built on the meta device, and its per-rank slice (the memory
model's shared facts; see speedllm.planner.memory).
"""

from dataclasses import dataclass, replace
from fnmatch import fnmatch
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from torch import nn

from speedllm.parallel.fsdp import expert_shard_dim
from speedllm.train.optimizer import muon_param_groups


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

    from speedllm.parallel.tensor import ShardedHeads

    if style is None or isinstance(style, (SequenceParallel, PrepareModuleInput, PrepareModuleOutput)):
        return None
    if isinstance(style, ShardedHeads):  # a Gated DeltaNet mixer's per-head vectors, the conv's channels
        return 0
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
        # every mixer's plan: attention, Gated DeltaNet with split or fused input projections (names do not overlap)
        plan = {**layer_plan(True), **layer_plan(True, linear=False), **layer_plan(True, linear=True)}
        local = module_fqn.split(".", 2)[2]
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
    """Shape of the first rank's piece of tensor t after TP, EP and then FSDP (dim 0; experts in their own FSDP
    unit under ep or tp: speedllm.parallel.fsdp.expert_shard_dim) sharding."""
    shape = list(t.shape)
    if t.expert and ep > 1:
        shape[0] = _chunk(shape[0], ep)
    if t.tp_dim is not None and tp > 1:
        shape[t.tp_dim] = _chunk(shape[t.tp_dim], tp)
    if fsdp > 1:
        dim = expert_shard_dim(shape[0], fsdp) if t.expert and ep * tp > 1 else 0
        shape[dim] = _chunk(shape[dim], fsdp)
    return tuple(shape)


def tp_facts(mt: ModelTensors) -> Tuple[bool, bool, bool]:
    """Whether the TP plan splits the dense MLP width, the experts' width and the vocabulary."""
    layer_tensors = [t for kind in mt.layer_kinds for t in kind]
    mlp = any(t.name == "mlp.gate_proj.weight" and t.tp_dim is not None for t in layer_tensors)
    experts = any(t.expert and t.tp_dim is not None for t in layer_tensors)
    vocab = any(t.tp_dim == 0 for t in mt.embed)
    return mlp, experts, vocab


def size(num_bytes: float) -> str:
    """Bytes in GiB, or MiB below 1 GiB, with 3 decimals."""
    return f"{num_bytes / GIB:.3f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.3f} MiB"
