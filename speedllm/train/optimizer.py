"""The optimizer of the `optim` config group over two parameter groups: decayed matrices, and undecayed
norms / biases (/ embeddings); optim=muon splits the matrices once more (muon_param_groups).

conf/optim/<name>.yaml names a torch optimizer class (`_target_`) and its keyword arguments; Hydra instantiates
it with `_partial_: true` and the code supplies the parameter groups.
"""

import dataclasses
import inspect
import math

import torch
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf
from torch import nn

from speedllm.errors import UserError
from speedllm.models.moe import MoE
from speedllm.models.qwen3 import Qwen3

# fields of the optim group that belong to the learning-rate schedule or to us, not to the optimizer class
NOT_OPTIMIZER_ARGS = ("name", "min_lr", "schedule", "warmup_steps", "decay_fraction", "decay_embeddings")


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool) -> list:
    """Split trainable parameters into a decayed and an undecayed group.

    Norm weights and biases (every 1-D parameter) are never decayed: shrinking a norm's gain toward 0
    fights the normalization instead of regularizing. Embedding tables are decayed only when asked.
    """
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    cfg = getattr(model, "cfg", None)
    if cfg is not None and cfg.tie_word_embeddings and model.lm_head is not None:
        embedding_params.add(id(model.lm_head.weight))  # a pipeline's last stage holds its own copy of the tie
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or (id(p) in embedding_params and not decay_embeddings):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # no empty group (LoRA trains matrices only): checkpoints key group settings by parameter name
    return _split_by_mesh([g for g in groups if g["params"]])


def muon_param_groups(model: nn.Module, decay_embeddings: bool) -> list:
    """optim=muon's groups (the standard Muon recipe): Muon for the hidden matrices -- attention and MLP
    projections, and each expert's matrices of the stacked [E, out, in] experts -- and AdamW for the rest:
    embeddings, the output projection, the MoE router, norms and biases. The embedding and output are lookups and
    a classifier, not hidden transforms; the router's few rows are logits whose scale matters.
    Weight decay as in param_groups: never on 1-D parameters, on embeddings only when asked."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    adamw_matrices = {id(m.gate.weight) for m in model.modules() if isinstance(m, MoE)}
    for m in model.modules():
        if isinstance(m, Qwen3) and m.lm_head is not None:  # a tie is an embedding (a last stage's own copy too)
            (embedding_params if m.cfg.tie_word_embeddings else adamw_matrices).add(id(m.lm_head.weight))
    muon, decay, no_decay = [], [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or (id(p) in embedding_params and not decay_embeddings):
            no_decay.append(p)
        elif id(p) in embedding_params or id(p) in adamw_matrices:
            decay.append(p)
        else:
            muon.append(p)
    groups = [{"params": muon, "muon": True}, {"params": decay, "muon": False},
              {"params": no_decay, "muon": False, "weight_decay": 0.0}]
    return _split_by_mesh([g for g in groups if g["params"]])


def _split_by_mesh(groups: list) -> list:
    """One group per device mesh when parameters live on several (expert parallelism): foreach kernels
    run per group and cannot mix DTensors of different meshes. A single mesh leaves the groups as they are."""
    from torch.distributed.tensor import DTensor

    def mesh_of(p):
        return p.device_mesh if isinstance(p, DTensor) else None

    if len({mesh_of(p) for g in groups for p in g["params"]}) <= 1:
        return groups
    split = []
    for g in groups:
        meshes = list(dict.fromkeys(mesh_of(p) for p in g["params"]))
        split += [{**g, "params": [p for p in g["params"] if mesh_of(p) == m]} for m in meshes]
    return split


def optimizer_args(optim) -> dict:
    """The optim group as Hydra instantiates it: `_target_`, `_partial_` and the class's keyword arguments."""
    fields = OmegaConf.to_container(optim, resolve=True) if OmegaConf.is_config(optim) else dataclasses.asdict(optim)
    return {k: v for k, v in fields.items() if k not in NOT_OPTIMIZER_ARGS}


def optimizer_errors(optim) -> list:
    """One-line problems with the optim group's `_target_` and arguments (empty when it can be built)."""
    try:
        cls = get_class(optim._target_)
    except Exception as e:  # hydra wraps import and attribute errors alike
        return [f"optim._target_={optim._target_} cannot be imported ({str(e).splitlines()[0]}); "
                "use optim=adamw|sgd|adafactor or a torch.optim class path"]
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        return [f"optim._target_={optim._target_} is not a torch.optim.Optimizer; use optim=adamw|sgd|adafactor"]
    accepted = inspect.signature(cls).parameters
    unknown = [k for k in optimizer_args(optim) if not k.startswith("_") and k not in accepted]
    if unknown:
        return [f"optim.{unknown[0]} is not an argument of {optim._target_}; pick the optimizer's own group "
                f"(optim=adamw|sgd|adafactor) instead of overriding optim._target_"]
    return []


def fused_adamw(device_type: str) -> bool:
    """Whether AdamW with `fused: null` (the adamw group's default) runs torch's fused kernel on this device type.

    Fused: one pass over each parameter, its gradient and moments, no temporaries (DTensor parameters too).
    Foreach makes ~10 passes and intermediate tensors: on the 2-core CPU box it took 0.25 s a step for 42M
    parameters against 0.06 s fused (~6% of a training step). Other devices (torch_npu) keep foreach.
    """
    return device_type in ("cpu", "cuda")


def build_optimizer(model: nn.Module, optim) -> torch.optim.Optimizer:
    """The `optim` group's optimizer over `model`'s parameter groups (lr is the peak; the scheduler scales it).

    `fused: null` lets the device decide between the fused and the foreach kernels (fused_adamw); muon's
    `ns_dtype: null` between torch's bfloat16 Newton-Schulz and float32 on CPUs (speedllm.train.muon).
    """
    if optim.name == "muon":
        groups = muon_param_groups(model, optim.decay_embeddings)
    else:
        groups = param_groups(model, optim.weight_decay, optim.decay_embeddings)
    args = optimizer_args(optim)
    device_type = next(model.parameters()).device.type
    if "fused" in args and args["fused"] is None:
        args["fused"] = fused_adamw(device_type)
        args["foreach"] = not args["fused"]
    if "ns_dtype" in args:
        args["ns_dtype"] = ns_dtype(optim, device_type)
    return instantiate({**args, "_convert_": "all"})(groups)


def ns_dtype(optim, device_type: str) -> str:
    """optim=muon's Newton-Schulz dtype: optim.ns_dtype, or (null) torch's bfloat16, float32 on CPUs."""
    if optim.ns_dtype is not None:
        return optim.ns_dtype
    return "float32" if device_type == "cpu" else "bfloat16"


def check_resumable(checkpoint, optim) -> None:
    """Optimizer state loads only into the optimizer that saved it: refuse another one in one line."""
    from speedllm import storage

    frozen = storage.join(checkpoint, "config.yaml")
    if not storage.is_file(frozen):
        return
    saved = OmegaConf.select(OmegaConf.create(storage.read_text(frozen)), "optim._target_",
                             default="torch.optim.AdamW")
    if saved != optim._target_:
        raise UserError(f"checkpoint {checkpoint} was saved with optimizer {saved} but this run uses "
                        f"{optim._target_} (optim={optim.name}); resume with the optimizer it was saved with, or "
                        "start from its weights with task=convert convert.to=hf and checkpoint.load_hf")


def state_numel(optim, shape, muon: bool = False) -> int:
    """Elements of the per-parameter state tensors `optim` keeps for a parameter (or shard) of `shape`;
    scalar step counters left out. The planner's optimizer bytes are these times 4 (fp32).

    Args:
        muon: optim=muon updates this parameter with Muon (one momentum buffer), not AdamW (muon_param_groups).
    """
    numel = math.prod(shape)
    name = optim._target_.rsplit(".", 1)[-1]
    if name == "MuonAdamW":
        return numel if muon else 2 * numel
    if name in ("AdamW", "Adam"):
        return 2 * numel
    if name == "SGD":
        return numel if optim.momentum else 0
    if name == "Adafactor":  # factored second moment of the last two dims: rows + columns
        if len(shape) < 2:
            return numel
        return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
    raise UserError(f"optim._target_={optim._target_}: the planner knows the state size of AdamW, Adam, SGD, "
                    "Adafactor and Muon; plan with one of those")
