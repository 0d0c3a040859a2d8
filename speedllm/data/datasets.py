"""Pretraining datasets over `.bin/.idx` files: train/valid/test split, GPT samples, weighted blending.

Every dataset here is an infinite, deterministic sequence: `ds[k]` is defined for every k >= 0, and
sample k is the same on every rank and in every run with the same seed, so a loader only has to
remember how many samples it consumed.
"""

import math
from functools import lru_cache
from typing import List, Sequence, Tuple

import numpy as np

from speedllm.data.indexed import IndexedDataset
from speedllm.errors import UserError

SPLITS = ("train", "valid", "test")
BLEND_PERIOD = 16384  # positions per blending period; weights are met to within 1/BLEND_PERIOD


def parse_split(split) -> List[float]:
    """'969,30,1' or [969, 30, 1] -> normalized [train, valid, test] weights (missing entries are 0)."""
    items = str(split).replace("/", ",").split(",") if isinstance(split, str) else list(split)
    try:
        weights = [float(x) for x in items]
    except ValueError:
        raise UserError(f"data.split={split}: expected comma-separated weights like 969,30,1") from None
    if len(weights) > 3:
        raise UserError(f"data.split={split}: at most three weights (train, valid, test), like 969,30,1")
    weights = (weights + [0.0, 0.0, 0.0])[:3]
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise UserError(f"data.split={split}: weights must be finite, non-negative, with a positive sum")
    return [w / sum(weights) for w in weights]


def split_range(num_items: int, split, name: str) -> Tuple[int, int]:
    """[start, end) of split `name` over num_items, contiguous, rounded as Megatron's get_split_indices."""
    weights = parse_split(split)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * num_items)))
    diff = bounds[-1] - num_items
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    i = SPLITS.index(name)
    return bounds[i], bounds[i + 1]


class GPTDataset:
    """Samples of `seq_len + 1` tokens over the concatenated documents of one split (Megatron's GPTDataset).

    Epoch e orders the split's documents by a permutation seeded with (seed, e), cuts the concatenation
    into samples that start every `seq_len` tokens (a sample's last token is the next one's first, so
    every token is a target exactly once), and visits those samples in a second seeded permutation.
    Tokens past the last whole sample of an epoch are not used in that epoch.
    """

    def __init__(self, indexed: IndexedDataset, doc_range: Tuple[int, int], seq_len: int, seed: int):
        self.indexed = indexed
        self.seq_len = seq_len
        self.seed = seed
        doc_idx = indexed.document_indices
        # One sequence per document in our files; Megatron files may hold several, all kept in order.
        self.sequences = np.arange(doc_idx[doc_range[0]], doc_idx[doc_range[1]], dtype=np.int64)
        num_tokens = int(indexed.sizes[self.sequences].sum(dtype=np.int64))
        self.samples_per_epoch = max(num_tokens - 1, 0) // seq_len
        if self.samples_per_epoch == 0:
            raise UserError(
                f"{indexed.prefix}: documents {doc_range[0]}..{doc_range[1]} hold {num_tokens} tokens, "
                f"fewer than one sample of seq_len+1={seq_len + 1} — lower train.seq_len or add data"
            )

    @lru_cache(maxsize=2)
    def _epoch(self, epoch: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(sequence order, start sequence position, start offset, sample order) of one epoch."""
        rng = np.random.default_rng([self.seed, epoch])
        order = self.sequences[rng.permutation(len(self.sequences))]
        ends = np.cumsum(self.indexed.sizes[order], dtype=np.int64)
        starts = np.arange(self.samples_per_epoch, dtype=np.int64) * self.seq_len
        position = np.searchsorted(ends, starts, side="right")
        offset = starts - (ends[position] - self.indexed.sizes[order][position])
        shuffle = rng.permutation(self.samples_per_epoch)
        return order, position, offset, shuffle

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __getitem__(self, k: int) -> np.ndarray:
        epoch, i = divmod(int(k), self.samples_per_epoch)
        order, position, offset, shuffle = self._epoch(epoch)
        j = shuffle[i]
        pos, off, need = int(position[j]), int(offset[j]), self.seq_len + 1
        parts = []
        while need > 0:
            seq = int(order[pos])
            take = min(need, int(self.indexed.sizes[seq]) - off)
            parts.append(self.indexed.get(seq, off, take))
            need -= take
            pos, off = pos + 1, 0
        return np.concatenate(parts).astype(np.int64)


def blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: position i goes to the dataset furthest below its share.

    Returns (dataset index, sample index within that dataset) for positions 0..size-1.
    """
    weights = np.asarray(weights, dtype=np.float64)
    counts = np.zeros(len(weights), dtype=np.int64)
    dataset_index = np.empty(size, dtype=np.int64)
    sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        d = int(np.argmax(weights * (i + 1) - counts))
        dataset_index[i], sample_index[i] = d, counts[d]
        counts[d] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """Datasets mixed by weight; the greedy blend of one period of BLEND_PERIOD positions repeats forever."""

    def __init__(self, datasets: List, weights: Sequence[float]):
        if len(datasets) != len(weights) or any(w <= 0 for w in weights):
            raise UserError(f"data.path: weights {list(weights)} must be positive, one per dataset")
        self.datasets = datasets
        self.weights = [w / sum(weights) for w in weights]
        self.dataset_index, self.sample_index = blending_indices(self.weights, BLEND_PERIOD)
        self.per_period = np.bincount(self.dataset_index, minlength=len(datasets))

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, k: int) -> np.ndarray:
        period, i = divmod(int(k), BLEND_PERIOD)
        d = int(self.dataset_index[i])
        return self.datasets[d][period * int(self.per_period[d]) + int(self.sample_index[i])]


def parse_data_path(path) -> List[Tuple[float, str]]:
    """data.path -> [(weight, prefix)]: one prefix, a list of prefixes, or [w1, prefix1, w2, prefix2, ...]."""
    items = [path] if isinstance(path, str) else list(path)
    if not items:
        raise UserError("data.path is empty — pass data.path=<prefix> or [w1, prefix1, w2, prefix2]")
    if all(isinstance(x, str) for x in items):
        return [(1.0, x) for x in items]
    if len(items) % 2 or not all(isinstance(w, (int, float)) and isinstance(p, str)
                                 for w, p in zip(items[::2], items[1::2])):
        raise UserError(f"data.path={items}: expected a prefix or a weighted list [w1, prefix1, w2, prefix2]")
    return [(float(w), p) for w, p in zip(items[::2], items[1::2])]


def build_pretrain_dataset(path, split, split_name: str, seq_len: int, seed: int):
    """The dataset for one split over data.path (one prefix or a weighted blend of several)."""
    from speedllm.data.indexed import exists

    parts = parse_data_path(path)
    datasets = []
    for i, (_, prefix) in enumerate(parts):
        if not exists(prefix):
            raise UserError(f"data.path: {prefix}.bin/.idx not found — run task=preprocess or fix the prefix")
        indexed = IndexedDataset(prefix)
        doc_range = split_range(len(indexed.document_indices) - 1, split, split_name)
        if doc_range[0] == doc_range[1]:
            raise UserError(
                f"data.split={split}: the {split_name} split of {prefix} has no documents — "
                "give it a larger weight or use another split"
            )
        # A distinct seed per blended dataset, so two copies of one corpus are not read in lockstep.
        datasets.append(GPTDataset(indexed, doc_range, seq_len, seed + 1009 * i))
    if len(datasets) == 1:
        return datasets[0]
    return BlendedDataset(datasets, [w for w, _ in parts])
