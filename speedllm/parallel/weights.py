"""Materialize a parallelized model with exactly the weights a single-process run would start from.

Rank 0 builds the whole model in host memory and initializes it with `Qwen3.init_weights` from the same RNG
state a single process has at that point; every tensor is then broadcast over the world, one at a time, and
each rank keeps its own piece (a DTensor shard, or a pipeline stage's tensors). So every layout starts from
the same weights as `parallel=single`, and a parallel run can be checked against it number for number.
Peak extra memory: the whole fp32 model in rank 0's host memory (not on its accelerator), one full tensor at a
time on every device. For models whose fp32 weights exceed a host's memory this start does not scale; load
weights instead (checkpoint.load / checkpoint.load_hf read only each rank's shards).
"""

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def _full_model(model_cfg, device: torch.device) -> nn.Module:
    from speedllm.models.qwen3 import Qwen3

    with torch.device("meta"):
        model = Qwen3(model_cfg)
    if device.type != "meta":
        model.to_empty(device=device)
        tie_embeddings(model)  # to_empty() unties shared weights
    return model


def tie_embeddings(model: nn.Module) -> None:
    """Re-tie lm_head to embed_tokens when the config ties them and this module holds both."""
    if model.cfg.tie_word_embeddings and model.lm_head is not None and model.embed_tokens is not None:
        if model.lm_head.weight is not model.embed_tokens.weight:
            model.lm_head.weight = model.embed_tokens.weight


@torch.no_grad()
def init_from_rank0(modules: list, model_cfg, device: torch.device) -> None:
    """Fill the (already materialized) parallel `modules` of this rank with rank 0's single-process init.

    Args:
        modules: this rank's model parts (one Qwen3, or several pipeline stages); every rank calls this.
        model_cfg: the architecture (schema ModelConfig).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        full = _full_model(model_cfg, torch.device("cpu"))
        full.init_weights()
        source = full.state_dict(keep_vars=True)
    else:
        source = _full_model(model_cfg, torch.device("meta")).state_dict(keep_vars=True)
    targets = {}
    for module in modules:
        # names as in the unwrapped model (activation recompute wraps layers)
        targets.update({k.replace("_checkpoint_wrapped_module.", ""): v for k, v in module.state_dict().items()})
    # tied tensors appear under two names: send them once, keep only those
    shared = {i for i, n in Counter(id(t) for t in source.values()).items() if n > 1}
    received = {}
    for name, tensor in source.items():
        buffer = received.get(id(tensor))
        if buffer is None:
            buffer = tensor.to(device) if rank == 0 else torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            if dist.is_initialized():
                dist.broadcast(buffer, src=0)
            if id(tensor) in shared:
                received[id(tensor)] = buffer
        target = targets.get(name)
        if target is None:
            continue
        if isinstance(target, DTensor):
            # From a replicated view to the target's placements is a local slice: no communication.
            whole = DTensor.from_local(buffer, target.device_mesh, [Replicate()] * target.device_mesh.ndim,
                                       run_check=False)
            target.to_local().copy_(whole.redistribute(placements=target.placements).to_local())
        else:
            target.copy_(buffer)
