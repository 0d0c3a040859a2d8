"""The training loader: deterministic, data-parallel sharded, resumable batches of CPU tensors.

Order (B = micro_batch_size, R = dp_size, r = dp_rank): the dataset is one infinite seeded sequence of
samples (see datasets.py / sft.py). Every call to `next()` consumes the next B * R samples globally;
rank r takes samples [consumed + r*B, consumed + (r+1)*B). So the R ranks' micro-batches of one call
are exactly the B*R consecutive samples a single process with micro_batch_size=B*R would take, and a
global step of G calls covers the same samples under any dp_size with the same B*R*G.

Batches are dicts of int64 tensors [B, S]: `tokens`, `labels` (label of position t is token t+1,
IGNORE_INDEX where there is no loss), and for packed SFT `position_ids` (restart at 0 per sample) and
`document_ids` (one id per sample within a row). `state_dict()` is {"consumed_samples": n}, the global index
of the next sample: the same on every rank, so a run resumed under any dp_size, micro batch or global batch goes
on with sample n, exactly where the uninterrupted run's order is.
"""

import fcntl
import hashlib
import json
from pathlib import Path
from typing import Dict

import numpy as np
import torch

from speedllm import storage
from speedllm.data.datasets import build_pretrain_dataset, parse_data_path
from speedllm.data.indexed import exists
from speedllm.data.tokenizer import load_tokenizer, tokenizer_vocab_size
from speedllm.errors import UserError, reading
from speedllm.paths import ASSETS

DEMO_CORPUS = ASSETS / "corpus" / "shakespeare.jsonl.xz"


def check_vocab(cfg, path=None) -> None:
    """UserError when data.tokenizer, or the tokenizer recorded in a `<prefix>.json` of data.path, can
    emit ids that the model's embedding (model.vocab_size) lacks."""
    sources = [(f"data.tokenizer={cfg.data.tokenizer}", tokenizer_vocab_size(str(cfg.data.tokenizer)))]
    for _, prefix in parse_data_path(path) if path is not None else []:
        meta = Path(prefix + ".json")
        if meta.is_file():
            with reading(f"data.path: {meta}", f"rerun task=preprocess to rewrite it, or delete {meta.name} (it "
                         "records the tokenizer's vocabulary size, checked against the model)"):
                size = json.loads(meta.read_text())["vocab_size"]
                if not isinstance(size, int):
                    raise TypeError(f"vocab_size is {size!r}, not an integer")
            sources.append((f"{prefix}.bin (see {meta.name})", size))
    for what, size in sources:
        if size > cfg.model.vocab_size:
            raise UserError(f"{what} has {size} token ids but model {cfg.model.name} has vocab_size="
                            f"{cfg.model.vocab_size}; use the model's tokenizer (and data tokenized with it) or a "
                            "model with a larger vocabulary")


def _digest(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


def demo_prefix(cfg) -> str:
    """The bundled corpus tokenized with data.tokenizer, built once into data.cache_dir and reused.

    The cache key hashes the corpus and the tokenizer files. A file lock makes concurrent ranks wait
    for the first one to build; the build itself writes temporary names and renames them at the end.
    """
    tok_dir = Path(str(cfg.data.tokenizer))
    tok_files = sorted(p for p in tok_dir.glob("tokenizer*.json"))
    key = _digest([DEMO_CORPUS, *tok_files])
    cache = Path(str(cfg.data.cache_dir)) / "demo"
    prefix = str(cache / f"shakespeare-{tok_dir.name}-{key}")
    if exists(prefix):
        return prefix
    from speedllm.data.preprocess import preprocess

    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(prefix + ".lock", "w")
    except OSError as e:
        raise UserError(f"data.cache_dir={cfg.data.cache_dir}: cannot write the tokenized demo corpus there "
                        f"({e.strerror}); set SPEEDLLM_CACHE=<a writable folder> (or data.cache_dir=)") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not exists(prefix):
            print(f"data=demo: tokenizing the bundled corpus with {tok_dir} into {prefix} (first use only)")
            preprocess(str(DEMO_CORPUS), prefix, str(tok_dir), ["text"], True, cfg.data.workers, "fail",
                       cfg.data.trust_remote_code, progress=False)
    return prefix


def local_data_path(path, cache_dir: str):
    """data.path with each URL prefix in it replaced by the prefix of local copies of its .bin/.idx/.json
    (downloaded once per version into cache_dir, see speedllm.storage)."""
    def local(item):
        is_prefix = isinstance(item, str) and storage.is_url(item)
        return storage.cached_prefix(item, (".bin", ".idx", ".json"), cache_dir) if is_prefix else item

    return local(path) if isinstance(path, str) else [local(item) for item in path]


class Loader:
    """Iterates forever over a dataset as described in the module docstring."""

    def __init__(self, dataset, dp_rank: int, dp_size: int, micro_batch_size: int, vocab_size: int = 0):
        self.dataset = dataset
        self.dp_rank, self.dp_size, self.micro_batch_size = dp_rank, dp_size, micro_batch_size
        self.vocab_size = vocab_size  # > 0: refuse token ids the model's embedding lacks
        self.consumed_samples = 0

    def __iter__(self) -> "Loader":
        return self

    @property
    def first_index(self) -> int:
        """The dataset index of this rank's first row in the next micro-batch."""
        return self.consumed_samples + self.dp_rank * self.micro_batch_size

    def __next__(self) -> Dict[str, torch.Tensor]:
        first = self.first_index
        samples = [self.dataset[first + i] for i in range(self.micro_batch_size)]
        self.consumed_samples += self.micro_batch_size * self.dp_size
        if isinstance(samples[0], dict):
            return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}
        x = torch.from_numpy(np.stack(samples))  # [B, S+1]
        if self.vocab_size and int(x.max()) >= self.vocab_size:
            raise UserError(f"data.path holds token id {int(x.max())} but model.vocab_size={self.vocab_size} — the "
                            "data was tokenized for another model; preprocess it with this model's tokenizer")
        return {"tokens": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous()}

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, sd: dict) -> None:
        self.consumed_samples = int(sd["consumed_samples"])


def build_loader(cfg, split: str, dp_rank: int, dp_size: int, micro_batch_size: int, seq_len: int, seed: int):
    """The loader of one split ("train" | "valid" | "test") for one data-parallel rank.

    data.format=pretrain reads data.path (None with data=demo: the cached bundled corpus); pairs reads
    preference pairs (speedllm.data.pairs); any other format reads SFT records from data.input with the
    tokenizer's chat template.
    """
    d = cfg.data
    if d.format == "pretrain":
        check_vocab(cfg)  # before building the demo cache with an unsuitable tokenizer
        path = d.path if d.path is not None else (demo_prefix(cfg) if d.name == "demo" else None)
        if path is None:
            raise UserError(
                "data.path is not set — pass data.path=<prefix> (or [w1, prefix1, w2, prefix2]) or data=demo"
            )
        path = local_data_path(path, d.cache_dir)
        check_vocab(cfg, path)
        dataset = build_pretrain_dataset(path, d.split, split, seq_len, seed)
        return Loader(dataset, dp_rank, dp_size, micro_batch_size, cfg.model.vocab_size)
    elif d.format == "pairs":
        from speedllm.data.pairs import PairDataset, load_pairs

        check_vocab(cfg)
        tokenizer = load_tokenizer(str(d.tokenizer), d.trust_remote_code)
        rows = load_pairs(d.input, tokenizer, seq_len, d.split, split)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        dataset = PairDataset(rows, seq_len, pad_id, seed)
    else:
        from speedllm.data.sft import SFTDataset, describe, load_sft_samples

        check_vocab(cfg)
        tokenizer = load_tokenizer(str(d.tokenizer), d.trust_remote_code)
        samples = load_sft_samples(d.input, d.format, tokenizer, d.loss_on, seq_len, d.overlong,
                                   d.on_error, d.split, split)
        if dp_rank == 0:
            print(f"sft {split} data: {describe(samples)}")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        dataset = SFTDataset(samples, seq_len, pad_id, d.packing, seed)
    return Loader(dataset, dp_rank, dp_size, micro_batch_size)
