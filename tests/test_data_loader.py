"""Datasets and loader: GPT samples, epochs, split, blending, dp sharding, resume, data=demo cache, vocab check."""

import os

import numpy as np
import pytest
import torch

from speedllm.config import compose_config
from speedllm.data.datasets import BlendedDataset, GPTDataset, build_pretrain_dataset, split_range
from speedllm.data.indexed import IndexedDataset, IndexedDatasetWriter
from speedllm.data.loader import Loader, build_loader
from speedllm.errors import UserError
from speedllm.paths import ASSETS

pytestmark = pytest.mark.unit


def write_unique(prefix, lengths, base=0):
    """Documents whose tokens are all distinct: doc d holds base + d*1000 + [0, length)."""
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d, n in enumerate(lengths):
            w.add_document(base + d * 1000 + np.arange(n))
        w.finalize()
    return prefix


def test_gpt_samples_cover_each_epoch_once(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, size=30).tolist()
    ds = GPTDataset(IndexedDataset(write_unique(str(tmp_path / "u"), lengths)), (0, 30), seq_len=16, seed=5)
    total = sum(lengths)
    assert len(ds) == (total - 1) // 16
    valid = {d * 1000 + i for d, n in enumerate(lengths) for i in range(n)}
    orders = []
    for epoch in range(2):
        samples = [ds[epoch * len(ds) + i] for i in range(len(ds))]
        inputs = np.concatenate([s[:-1] for s in samples])
        assert len(set(inputs.tolist())) == len(inputs) == len(ds) * 16, "every token is an input at most once"
        assert set(inputs.tolist()) <= valid
        for s in samples:  # inside one document consecutive tokens are consecutive ids
            same_doc = s[1:] // 1000 == s[:-1] // 1000
            assert np.all(s[1:][same_doc] == s[:-1][same_doc] + 1)
            # a document boundary always enters the next document at its first token
            assert np.all(s[1:][~same_doc] % 1000 == 0)
        orders.append([int(s[0]) for s in samples])
    assert orders[0] != orders[1], "each epoch reshuffles"
    again = GPTDataset(IndexedDataset(str(tmp_path / "u")), (0, 30), seq_len=16, seed=5)
    assert all(np.array_equal(ds[k], again[k]) for k in range(0, 3 * len(ds), 7)), "deterministic"


def test_split_ranges_follow_megatron_rounding():
    assert [split_range(42, "969,30,1", n) for n in ("train", "valid", "test")] == [(0, 41), (41, 42), (42, 42)]
    assert [split_range(10, "8,1,1", n) for n in ("train", "valid", "test")] == [(0, 8), (8, 9), (9, 10)]


def test_blend_follows_weights(tmp_path):
    a = write_unique(str(tmp_path / "a"), [500] * 8)
    b = write_unique(str(tmp_path / "b"), [500] * 8, base=10**6)
    ds = build_pretrain_dataset([0.3, a, 0.7, b], "1,0,0", "train", seq_len=8, seed=1)
    assert isinstance(ds, BlendedDataset)
    n = 20000  # crosses the blending period and both datasets' epochs
    from_a = sum(int(ds[k][0] < 10**6) for k in range(n))
    assert abs(from_a / n - 0.3) < 0.002


def test_dp_shards_union_equals_single_process(tmp_path):
    ds = GPTDataset(IndexedDataset(write_unique(str(tmp_path / "u"), [300] * 10)), (0, 10), 16, seed=2)
    single = Loader(ds, 0, 1, micro_batch_size=6)
    ranks = [Loader(ds, r, 3, micro_batch_size=2) for r in range(3)]
    for _ in range(5):
        want = next(single)
        got = [next(r) for r in ranks]
        for key in ("tokens", "labels"):
            assert torch.equal(torch.cat([g[key] for g in got]), want[key])
    assert all(r.state_dict() == single.state_dict() == {"consumed_samples": 30} for r in ranks)


def test_demo_pretrain_loader_resume_and_cache(tmp_path):
    cfg = compose_config(f"data.cache_dir={tmp_path}")
    full = build_loader(cfg, "train", dp_rank=1, dp_size=2, micro_batch_size=2, seq_len=32, seed=7)
    batches = [next(full) for _ in range(6)]
    cached = sorted(p.name for p in (tmp_path / "demo").iterdir())
    assert [p for p in cached if p.endswith((".bin", ".idx", ".json"))] and len(cached) == 4
    mtime = os.path.getmtime(next((tmp_path / "demo").glob("*.idx")))

    stopped = build_loader(cfg, "train", 1, 2, 2, 32, 7)
    for _ in range(3):
        next(stopped)
    sd = stopped.state_dict()
    resumed = build_loader(cfg, "train", 1, 2, 2, 32, 7)  # reuses the cache
    resumed.load_state_dict(sd)
    for want in batches[3:]:
        got = next(resumed)
        assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(got["labels"], want["labels"])
    assert os.path.getmtime(next((tmp_path / "demo").glob("*.idx"))) == mtime
    b = batches[0]
    assert b["tokens"].shape == (2, 32) and b["tokens"].dtype == torch.int64
    assert torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1]), "labels are the tokens shifted by one"
    assert int(b["tokens"].max()) < cfg.model.vocab_size
    with pytest.raises(UserError, match="test split"):
        build_loader(cfg, "test", 0, 1, 2, 32, 7)


def test_sft_loader_resume_across_epochs(tmp_path):
    cfg = compose_config("task=sft", "data.split=[1,0,0]")
    loader = build_loader(cfg, "train", 0, 1, micro_batch_size=8, seq_len=128, seed=3)
    rows_per_epoch = len(loader.dataset)
    k = rows_per_epoch // 8 - 1  # the uninterrupted run crosses into the second epoch after the restore
    for _ in range(k):
        next(loader)
    sd = loader.state_dict()
    want = [next(loader) for _ in range(3)]
    resumed = build_loader(cfg, "train", 0, 1, 8, 128, 3)
    resumed.load_state_dict(sd)
    for w in want:
        got = next(resumed)
        assert set(got) == {"tokens", "labels", "position_ids", "document_ids"}
        assert all(torch.equal(got[key], w[key]) for key in w)


def test_unpacked_sft_has_no_document_fields():
    cfg = compose_config("task=sft", "data.packing=false")
    batch = next(build_loader(cfg, "valid", 0, 1, 4, 96, 0))
    assert set(batch) == {"tokens", "labels"} and batch["tokens"].shape == (4, 96)


def test_tokenizer_larger_than_embedding_is_rejected():
    cfg = compose_config("data.tokenizer=${asset:tokenizers/qwen3}")
    with pytest.raises(UserError, match="has 151669 token ids but model qwen3_tiny has vocab_size=8192; "):
        build_loader(cfg, "train", 0, 1, 1, 16, 0)


def test_resume_under_any_layout_goes_on_from_the_next_global_sample(tmp_path):
    """A position saved under another layout or global batch (6 samples: no multiple of this 4 ranks x 2) goes on
    with samples 6..13 of the one global order, split over the ranks."""
    ds = GPTDataset(IndexedDataset(write_unique(str(tmp_path / "u"), [300] * 4)), (0, 4), 16, seed=2)
    batches = []
    for rank in range(4):
        loader = Loader(ds, rank, 4, micro_batch_size=2)
        loader.load_state_dict({"consumed_samples": 6})
        batches.append(next(loader))
        assert loader.state_dict() == {"consumed_samples": 14}
    taken = np.concatenate([np.concatenate([b["tokens"], b["labels"][:, -1:]], 1) for b in batches])
    np.testing.assert_array_equal(taken, np.stack([ds[i] for i in range(6, 14)]))


def test_data_tokenized_for_a_larger_vocab_is_rejected(tmp_path):
    from speedllm.data.preprocess import preprocess

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "' + "word " * 400 + '"}\n')
    preprocess(str(src), str(tmp_path / "big"), str(ASSETS / "tokenizers" / "qwen3"), progress=False)
    cfg = compose_config(f"data.path={tmp_path}/big", "data.split=[1,0,0]")
    with pytest.raises(UserError, match=r"big.bin \(see big.json\) has 151669 token ids but model qwen3_tiny has "):
        build_loader(cfg, "train", 0, 1, 1, 16, 0)


def _build_demo(cfg, queue):
    from speedllm.data.loader import demo_prefix

    queue.put(demo_prefix(cfg))


def test_concurrent_ranks_build_the_demo_cache_once(tmp_path, capfd):
    import multiprocessing as mp

    cfg = compose_config(f"data.cache_dir={tmp_path}")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_demo, args=(cfg, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    prefixes = {queue.get(timeout=120) for _ in procs}
    for p in procs:
        p.join()
    assert len(prefixes) == 1 and capfd.readouterr().out.count("first use only") == 1
    ds = IndexedDataset(prefixes.pop())
    assert len(ds) == 42 and ds.num_tokens > 10**6
