"""task=preprocess: raw text (jsonl, parquet, txt, possibly compressed) into a Megatron-format .bin/.idx/.json
data set (speedllm.data.preprocess does the work; this task reports it).

    python launch.py task=preprocess data.input=<files or globs> data.output_prefix=<prefix> data.workers=2
"""

from speedllm import storage
from speedllm.data.preprocess import preprocess
from speedllm.errors import UserError


def run(cfg, rt=None) -> dict:
    """task=preprocess entry (rank 0, in process): writes `data.output_prefix`.{bin,idx,json} and reports.

    `rt` is the launcher's Runtime, unused: preprocessing is one process with its own worker pool.
    """
    d = cfg.data
    if not d.output_prefix:
        raise UserError("data.output_prefix is not set — pass data.output_prefix=<path prefix for .bin/.idx>")
    inputs = storage.local_inputs(d.input, d.cache_dir)  # URLs: local copies (cached), then as local files
    with storage.local_output(d.output_prefix, d.cache_dir) as prefix:  # a URL: written here, then uploaded
        meta = preprocess(
            inputs, prefix, d.tokenizer, list(d.text_key), d.append_eod, d.workers, d.on_error,
            d.trust_remote_code, progress=cfg.logging.progress_bar,
        )
    skipped = sum(meta["skipped"].values())
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(meta["skipped"].items()))
    print(
        f"preprocess: read {meta['num_documents'] + skipped} records, wrote {meta['num_documents']} documents "
        f"({meta['num_tokens']} tokens) -> {d.output_prefix}.bin/.idx/.json ({meta['dtype']}), skipped {skipped}"
        + (f" ({reasons})" if skipped else "")
        + f"; {meta['tokens_per_second']:.0f} tokens/s with {d.workers} worker(s) ({meta['seconds']:.2f}s, plus "
        f"{meta['setup_seconds']:.2f}s loading the tokenizer)"
    )
    return meta
