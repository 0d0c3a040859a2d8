"""AdamW with two parameter groups: decayed matrices, and undecayed norms / biases (/ embeddings)."""

import torch
from omegaconf import DictConfig
from torch import nn

from speedllm.errors import UserError


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
    return _split_by_mesh(groups)


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


def fused_adamw(device_type: str) -> bool:
    """Whether AdamW runs torch's fused kernel on this device type (else the foreach path).

    Fused: one pass over each parameter, its gradient and moments, no temporaries (DTensor parameters too).
    Foreach makes ~10 passes and intermediate tensors: on the 2-core CPU box it took 0.25 s a step for 42M
    parameters against 0.06 s fused (~6% of a training step). Other devices (torch_npu) keep foreach.
    """
    return device_type in ("cpu", "cuda")


def build_optimizer(model: nn.Module, optim: DictConfig) -> torch.optim.Optimizer:
    """AdamW from the `optim` config group (lr is the peak; the scheduler scales it per step)."""
    if optim.name != "adamw":
        raise UserError(f"optim.name={optim.name!r} is not supported; use optim.name=adamw")
    groups = param_groups(model, optim.weight_decay, optim.decay_embeddings)
    fused = fused_adamw(next(model.parameters()).device.type)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, fused=fused,
                             foreach=not fused)
