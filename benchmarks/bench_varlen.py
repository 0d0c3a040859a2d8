"""Packed-sequence training step: varlen attention (per document) against the [S, S] document mask.

    python benchmarks/bench_varlen.py [--seq-len 4096] [--doc-len 256] [--repeats 3]

qwen3_tiny (conf/model/qwen3_tiny.yaml) on one row of seq_len tokens packed with documents of about doc_len
tokens (uniform in [doc_len/2, 3*doc_len/2]); one forward+backward per call. The two paths alternate
(interleaved repeats, median) and are timed in process CPU seconds (all threads), which a loaded machine
distorts less than wall time. Peak memory is torch's MemTracker
over one step (tensor bytes: parameters, gradients, activations, temporaries), not the process RSS.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 2**20


def build(seq_len: int, doc_len: int):
    from omegaconf import OmegaConf

    from speedllm.models.config import ModelConfig
    from speedllm.models.qwen3 import Qwen3

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "speedllm/conf/model/qwen3_tiny.yaml"),
                          {"tokenizer": "none", "max_position_embeddings": seq_len})
    model = Qwen3(cfg)
    model.init_weights(seed=0)
    gen = torch.Generator().manual_seed(0)
    docs, positions = torch.zeros(1, seq_len, dtype=torch.long), torch.zeros(1, seq_len, dtype=torch.long)
    at, doc = 0, 0
    while at < seq_len:
        n = min(int(torch.randint(doc_len // 2, 3 * doc_len // 2 + 1, (1,), generator=gen)), seq_len - at)
        docs[0, at:at + n], positions[0, at:at + n] = doc, torch.arange(n)
        at, doc = at + n, doc + 1
    tokens = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=gen)
    return model, tokens, positions, docs, doc


def steps(model, tokens, positions, docs):
    """{path: one forward+backward} for the varlen (default) and the masked path."""
    from speedllm.models.qwen3 import masked_attention

    mask = model.attention_mask(1, docs.shape[1], 0, docs, None, None, "cpu")

    def step(**attend):
        ce_sum, _ = model(tokens[:, :-1], labels=tokens[:, 1:], position_ids=positions, document_ids=docs, **attend)
        ce_sum.backward()
        model.zero_grad(set_to_none=True)

    return {"varlen": lambda: step(), "mask": lambda: step(attend=masked_attention(model.ops.attention, mask))}


def peak_bytes(model, fn) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        fn()
    return next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--doc-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokens, positions, docs, num_docs = build(args.seq_len, args.doc_len)
    fns = steps(model, tokens, positions, docs)
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    peaks = {name: peak_bytes(model, fn) for name, fn in fns.items()}
    print(f"qwen3_tiny, seq_len {args.seq_len}, {num_docs} documents (~{args.doc_len} tokens), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| path | step CPU s (median) | peak tensor MiB |")
    print("|---|---|---|")
    for name in fns:
        print(f"| {name} | {statistics.median(times[name]):.3f} | {peaks[name] / MiB:.0f} |")
    t = {name: statistics.median(v) for name, v in times.items()}
    print(f"varlen: x{t['mask'] / t['varlen']:.2f} faster, peak x{peaks['mask'] / peaks['varlen']:.2f} lower")


if __name__ == "__main__":
    main()
