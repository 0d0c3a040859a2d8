"""QLoRA's frozen base in NF4 (torchao), in one process or sharded by FSDP2.

The adapted projections' weights become NF4 placeholders on the meta device before FSDP2 (`nf4_placeholders`),
so that FSDP2 shards them as NF4 (torchao's NF4Tensor implements FSDP2's all-gather hooks, on dim 0). The loaders
then fill a placeholder from its whole fp32 tensor, one tensor at a time (`fill_nf4_`): torchao quantizes the
whole tensor (one scaler mean per tensor, as in one process) and the rank keeps its rows. No rank holds the
fp32 base beyond the tensor being filled.

torchao's NF4 (to_nf4 defaults): a 4-bit code per weight, an int8 scaler per block of 64 weights, an fp32 factor
per 256 scalers (double quantization), and one fp32 scaler mean per tensor.
"""

from typing import Dict

import torch
from torch import nn
from torch.distributed.tensor import DTensor


NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
NF4_BYTES = 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)


def is_nf4(tensor: torch.Tensor) -> bool:
    """True for an NF4 weight (or a DTensor shard of one)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return type(local).__name__ == "NF4Tensor"


def nf4_placeholders(linears: Dict[str, nn.Linear]) -> None:
    """Replace each Linear's (meta) weight by a frozen NF4 one of the same shape, to be filled by fill_nf4_
    (validation made sure each weight, and each FSDP2 shard of it, holds whole double-quantization blocks)."""
    from torchao.quantization import to_nf4

    for linear in linears.values():
        linear.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)


@torch.no_grad()
def fill_nf4_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Give NF4 placeholder `param` (plain, or FSDP2's Shard(0) DTensor) the NF4 of the whole fp32 tensor `full`."""
    from torchao.quantization import to_nf4

    nf4 = to_nf4(full.to(param.dtype).contiguous())
    local = param
    if isinstance(param, DTensor):
        mesh, local = param.device_mesh, param._local_tensor  # to_local() would give a new NF4 object
        nf4 = torch.chunk(nf4, mesh.size(), dim=0)[mesh.get_local_rank()]
    # every inner tensor, the per-tensor scaler mean and the code table too: a placeholder materialized from the
    # meta device still has those on meta (torchao's empty_like keeps them), so copy_ could not fill them
    names, _ = local.__tensor_flatten__()
    for name in names:
        setattr(local, name, getattr(nf4, name).to(local.device))
