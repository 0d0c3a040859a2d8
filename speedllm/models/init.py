"""Initial weights that do not depend on how a tensor is split: any block of a tensor can be drawn on its own.

A tensor's values come in chunks of whole rows (dim 0). Chunk i of tensor `name` is drawn from a CPU generator
seeded by (seed, name, i), and the chunk boundaries depend only on the tensor's shape. So a rank that holds rows
[a, b) draws only the chunks that overlap them, a rank that holds some columns draws every chunk in turn and keeps
its columns, and the values equal the whole tensor's in a single process: whatever the layout, bit for bit.
(One generator over the whole tensor would not do: CPU normal_ of N values is not a prefix of 2N values.) The CPU
draws them on every device type, so a GPU or NPU run starts from exactly the CPU's weights; at most one chunk
is held beyond the block being filled.
"""

import hashlib
import math
from typing import Callable, Sequence

import torch

CHUNK_NUMEL = 1 << 22  # values per chunk (16 MB in fp32): large enough to draw fast, small enough to hold anywhere


def chunk_rows(shape: Sequence[int]) -> int:
    """Rows of dim 0 per chunk of a tensor of `shape` (at least one)."""
    return max(1, CHUNK_NUMEL // math.prod(shape[1:]))


def chunk_generator(seed: int, name: str, chunk: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


@torch.no_grad()
def normal_block_(out: torch.Tensor, name: str, shape: Sequence[int], offset: Sequence[int], std: float,
                  seed: int) -> None:
    """Fill `out` with its block of tensor `name` ~ Normal(0, std): global indices offset[d] .. offset[d] + size[d].

    Args:
        shape: the whole tensor's shape; `out` is the block of it starting at `offset` (one entry per dim).
    """
    random_block_(out, name, shape, offset, seed, lambda t, generator: t.normal_(0.0, std, generator=generator))


@torch.no_grad()
def log_uniform_block_(out: torch.Tensor, name: str, shape: Sequence[int], offset: Sequence[int], low: float,
                       high: float, seed: int) -> None:
    """Fill `out` with its block of tensor `name` ~ log(Uniform(low, high)) (Gated DeltaNet's A_log)."""
    random_block_(out, name, shape, offset, seed,
                  lambda t, generator: t.uniform_(low, high, generator=generator).log_())


@torch.no_grad()
def random_block_(out: torch.Tensor, name: str, shape: Sequence[int], offset: Sequence[int], seed: int,
                  draw: Callable[[torch.Tensor, torch.Generator], None]) -> None:
    """Fill `out` with its block of tensor `name`, each chunk's values made by draw(fp32 CPU tensor, generator)."""
    if out.numel() == 0:
        return
    rows = chunk_rows(shape)
    start, stop = offset[0], offset[0] + out.shape[0]
    cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:]))
    # whole rows of a CPU fp32 tensor: draw each chunk in place (the same values, without a copy)
    in_place = (out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
                and tuple(out.shape[1:]) == tuple(shape[1:]))
    for chunk in range(start // rows, (stop - 1) // rows + 1):
        lo, hi = chunk * rows, min((chunk + 1) * rows, shape[0])
        generator = chunk_generator(seed, name, chunk)
        if in_place and start <= lo and hi <= stop:
            draw(out[lo - start:hi - start], generator)
            continue
        values = torch.empty((hi - lo, *shape[1:]))
        draw(values, generator)
        a, b = max(lo, start), min(hi, stop)
        out[a - start:b - start].copy_(values[(slice(a - lo, b - lo), *cols)])
