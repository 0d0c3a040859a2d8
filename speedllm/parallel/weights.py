"""Per-shard initialization: every rank fills only the pieces of the model it holds, with exactly the values a
single-process run starts from (`Qwen3.init_weights`, same seed), whatever the layout.

A parameter is a DTensor (TP, EP, FSDP2, or several: one block of the whole tensor, at the offset DTensor reports,
with FSDP2's uneven dim-0 split respected) or a plain tensor (a pipeline stage's, or a single process'). Either way
the block is drawn from generators keyed by the parameter's name (speedllm.models.init), so no rank builds the
whole model, no tensor crosses the network, and no rank holds more than one chunk of values beyond its own shards.
"""

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from speedllm.models.qwen3 import init_block_
from speedllm.quant.nf4 import fill_nf4_, is_nf4


@torch.no_grad()
def init_shards(modules: list, model_cfg, seed: int) -> None:
    """Fill this rank's (already materialized) parameters of `modules` with their single-process initial values.

    Args:
        modules: this rank's model parts (one Qwen3, or several pipeline stages; shared tensors are filled once).
        model_cfg: the architecture (schema ModelConfig).
        seed: the run's seed (cfg.seed), the same on every rank.
    """
    done = set()
    for module in modules:
        for name, param in module.named_parameters():
            if id(param) in done:
                continue
            done.add(id(param))
            name = name.replace("_checkpoint_wrapped_module.", "")  # names as in the unwrapped model
            if is_nf4(param):  # QLoRA's base: NF4 of the whole initial tensor (one tensor at a time)
                full = torch.empty(param.shape)
                init_block_(full, name, param.shape, (0,) * param.ndim, model_cfg, seed)
                fill_nf4_(param, full)
            elif isinstance(param, DTensor):
                _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                init_block_(param.to_local(), name, param.shape, offset, model_cfg, seed)
            else:
                init_block_(param, name, param.shape, (0,) * param.ndim, model_cfg, seed)
