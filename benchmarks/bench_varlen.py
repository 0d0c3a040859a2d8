"""Packed-sequence training step: varlen attention (per document) against the [S, S] document mask.

    python -m benchmarks varlen [--seq-len 4096] [--doc-len 256] [--repeats 3] [--dry]

qwen3_tiny (conf/model/qwen3_tiny.yaml) on one row of seq_len tokens packed with documents of about doc_len
tokens (uniform in [doc_len/2, 3*doc_len/2]); one forward+backward per call. The two paths alternate
(interleaved repeats, median) and are timed in process CPU seconds (all threads), which a loaded machine
distorts less than wall time. Peak memory is torch's MemTracker
over one step (tensor bytes: parameters, gradients, activations, temporaries), not the process RSS.
"""

import statistics
import time

import torch
from omegaconf import OmegaConf

from benchmarks.common import MiB, interleaved, make_parser, parse, peak_tensor_bytes
from speedllm.models.config import ModelConfig
from speedllm.models.qwen3 import Qwen3, masked_attention
from speedllm.paths import CONF


def build(seq_len: int, doc_len: int):
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / "qwen3_tiny.yaml"),
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
    mask = model.attention_mask(1, docs.shape[1], 0, docs, None, None, "cpu")

    def step(**attend):
        ce_sum, _ = model(tokens[:, :-1], labels=tokens[:, 1:], position_ids=positions, document_ids=docs, **attend)
        ce_sum.backward()
        model.zero_grad(set_to_none=True)

    return {"varlen": lambda: step(), "mask": lambda: step(attend=masked_attention(model.ops.attention, mask))}


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--doc-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parse(parser, argv, seq_len=256, doc_len=64, repeats=1)
    model, tokens, positions, docs, num_docs = build(args.seq_len, args.doc_len)
    fns = steps(model, tokens, positions, docs)
    times, _ = interleaved(fns, args.repeats, time.process_time, warmup=1)
    peaks = {name: peak_tensor_bytes(fn, model) for name, fn in fns.items()}
    print(f"qwen3_tiny, seq_len {args.seq_len}, {num_docs} documents (~{args.doc_len} tokens), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| path | step CPU s (median) | peak tensor MiB |")
    print("|---|---|---|")
    for name in fns:
        print(f"| {name} | {statistics.median(times[name]):.3f} | {peaks[name] / MiB:.0f} |")
    t = {name: statistics.median(v) for name, v in times.items()}
    print(f"varlen: x{t['mask'] / t['varlen']:.2f} faster, peak x{peaks['mask'] / peaks['varlen']:.2f} lower")
