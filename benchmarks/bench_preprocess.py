"""Preprocessing throughput (tokens/s) of the bundled Shakespeare corpus with the bundled Qwen3 tokenizer.

    python -m benchmarks preprocess [--workers 1 2] [--repeat 3] [--dry]

Times `speedllm.data.preprocess.preprocess` end to end (worker start-up and tokenizer loading included,
as a user sees it) and its tokenizing phase alone; best of --repeat runs per worker count.
"""

import tempfile

from benchmarks.common import make_parser, parse, timed
from speedllm.data.preprocess import preprocess
from speedllm.paths import ASSETS


def main(argv=None) -> None:
    parser = make_parser(__name__, __doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokenizer", default=str(ASSETS / "tokenizers" / "qwen3"))
    args = parse(parser, argv, workers=[1], repeat=1)
    corpus = str(ASSETS / "corpus" / "shakespeare.jsonl.xz")
    print("| workers | documents | tokens | end-to-end s | end-to-end tokens/s | tokenizing tokens/s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            best, best_rate = None, 0.0
            for r in range(args.repeat):
                seconds, meta = timed(lambda: preprocess(corpus, f"{tmp}/w{workers}r{r}", args.tokenizer,
                                                         workers=workers, progress=False))
                best = seconds if best is None else min(best, seconds)
                best_rate = max(best_rate, meta["tokens_per_second"])
            print(f"| {workers} | {meta['num_documents']} | {meta['num_tokens']} | {best:.2f} | "
                  f"{meta['num_tokens'] / best:,.0f} | {best_rate:,.0f} |")
