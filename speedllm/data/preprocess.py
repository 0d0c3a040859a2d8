"""Preprocessing (task=preprocess): text files -> a Megatron `.bin/.idx` pair plus `<prefix>.json` metadata.

Inputs: `.jsonl` (one JSON object per line), `.json` (a list of objects), `.parquet`, or plain text
(`.txt` or anything else: one document per file); `.gz` / `.xz` / `.bz2` compression is read
transparently. With several `data.text_key` entries, the present values are joined by a blank line.
The end-of-document token (`<|endoftext|>` when the tokenizer has it, else its eos) ends every document.

    python launch.py task=preprocess data.input='corpus/*.jsonl' data.output_prefix=out/corpus \\
        data.tokenizer='${asset:tokenizers/qwen3}' data.workers=2
"""

import bz2
import glob
import gzip
import json
import lzma
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

from speedllm.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from speedllm.data.tokenizer import load_tokenizer, tokenizer_vocab_size
from speedllm.errors import UserError, reading

# A worker task holds documents up to this many characters (or CHUNK_DOCS documents): large enough to
# amortize pickling, small enough that a corpus of a few books still spreads over all workers.
CHUNK_CHARS = 1 << 18
CHUNK_DOCS = 256
OPENERS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}
EMPTY = "empty document"  # skipped whatever data.on_error says, and counted


def expand_inputs(inputs) -> List[str]:
    """Files named by a path, a glob, or a list of them, in sorted order within each glob."""
    if inputs is None:
        raise UserError("data.input is not set — pass data.input=<file or glob> (jsonl, json, parquet or text)")
    patterns = [inputs] if isinstance(inputs, str) else list(inputs)
    files = []
    for pattern in patterns:
        matched = sorted(glob.glob(str(pattern), recursive=True))
        if not matched:
            raise UserError(f"data.input={pattern}: no such file — check the path or glob")
        files += [f for f in matched if os.path.isfile(f)]
    return files


def _kind(path: str) -> Tuple[str, Optional[str]]:
    """(format, compression suffix) of a file name."""
    suffixes = Path(path).suffixes
    comp = suffixes[-1] if suffixes and suffixes[-1] in OPENERS else None
    rest = suffixes[:-1] if comp else suffixes
    ext = rest[-1] if rest else ""
    fmt = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}.get(ext, "text")
    return fmt, comp


def _bad(where: str, reason: str, fix: str) -> UserError:
    """A one-line error for a bad record; `.reason` is its category in the skipped counts."""
    err = UserError(f"{where}: {reason} — {fix}")
    err.reason = reason.split(" (")[0]
    return err


def _read_bytes(path: str, comp: Optional[str]) -> bytes:
    opener = OPENERS.get(comp, open)
    with opener(path, "rb") as f:
        return f.read()


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(where, f"invalid UTF-8 (byte {e.start})", "re-encode the file as UTF-8") from None


def read_records(path: str) -> Iterator[Tuple[str, object]]:
    """Yield (location "file:line", record-or-UserError) for every record of one input file.

    Bad records come back as a UserError value instead of raising, so the caller decides fail or skip; a file
    that cannot be read at all (corrupt compression, not the format its name says) raises one line naming it.
    """
    with reading(path, "check that it is what its name says (.jsonl, .json, .parquet or text; .gz/.xz/.bz2 "
                 "compressed) and not damaged"):
        yield from _records(path)


def _records(path: str) -> Iterator[Tuple[str, object]]:
    fmt, comp = _kind(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
    elif fmt == "text":
        try:
            yield f"{path}:1", {"text": _decode(_read_bytes(path, comp), path)}
        except UserError as e:
            yield path, e
    elif fmt == "json":
        try:
            rows = json.loads(_decode(_read_bytes(path, comp), path))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{e.lineno}: malformed JSON ({e.msg}) — fix the file") from None
        if isinstance(rows, dict):
            rows = [rows]
        if not isinstance(rows, list):
            raise UserError(f"{path}: holds a JSON {type(rows).__name__}, not a list of records; write "
                            "[{...}, {...}] or use .jsonl with one object per line")
        for i, row in enumerate(rows):
            yield f"{path}:item {i}", row
    else:
        opener = OPENERS.get(comp, open)
        with opener(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                where = f"{path}:{lineno}"
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(_decode(line, where))
                except UserError as e:
                    yield where, e
                except json.JSONDecodeError as e:
                    yield where, _bad(where, f"malformed JSON line ({e.msg})", "fix or remove the line")


def record_text(where: str, record, text_keys: Sequence[str]) -> str:
    """The document text of one record, or raise UserError naming the line and the key."""
    if not isinstance(record, dict):
        raise _bad(where, f"not a JSON object ({type(record).__name__})", "write one object per record")
    parts = [record[k] for k in text_keys if record.get(k) is not None]
    if not parts:
        raise _bad(
            where, f"missing key {'/'.join(text_keys)} (has {sorted(record)[:8]})",
            "set data.text_key to the field that holds the text",
        )
    if not all(isinstance(p, str) for p in parts):
        raise _bad(where, f"{'/'.join(text_keys)} is not text ({type(parts[0]).__name__})",
                   "set data.text_key to a field that holds a string")
    return "\n\n".join(parts)


def iter_documents(files: List[str], text_keys: Sequence[str], on_error: str, skipped: dict) -> Iterator[str]:
    """Document texts of all files in order; bad records raise (on_error=fail) or are counted in `skipped`.

    A file that cannot be parsed at all (a `.json` that is not JSON) always raises.
    """
    if on_error not in ("fail", "skip"):
        raise UserError(f"data.on_error={on_error}: must be fail or skip")
    for path in files:
        for where, record in read_records(path):
            try:
                if isinstance(record, UserError):
                    raise record
                text = record_text(where, record, text_keys)
                if not text.strip():  # web corpora have them; Megatron skips them too
                    skipped[EMPTY] = skipped.get(EMPTY, 0) + 1
                    continue
                yield text
            except UserError as e:
                if on_error == "fail":
                    raise
                skipped[e.reason] = skipped.get(e.reason, 0) + 1


def eod_token_id(tokenizer) -> int:
    """`<|endoftext|>` when the vocabulary has it (Qwen's document separator), else the eos token."""
    eod = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if eod is None or eod == tokenizer.unk_token_id:
        eod = tokenizer.eos_token_id
    if eod is None:
        raise UserError("data.tokenizer has neither <|endoftext|> nor an eos token — set data.append_eod=false")
    return eod


_worker_state = {}


def _init_worker(tokenizer_path: str, trust_remote_code: bool, append_eod: bool, dtype: str) -> None:
    tok = load_tokenizer(tokenizer_path, trust_remote_code)
    _worker_state.update(tok=tok, eod=eod_token_id(tok) if append_eod else None, dtype=np.dtype(dtype))


def _encode_chunk(texts: List[str]) -> Tuple[bytes, List[int]]:
    """Tokenize a chunk of documents into (raw bytes in the output dtype, per-document lengths)."""
    st = _worker_state
    backend = getattr(st["tok"], "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer behind an HF fast tokenizer, minus the offsets HF would also compute.
        ids = [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    else:
        # verbose=False: whole books exceed model_max_length, which only matters to a model, not here.
        ids = st["tok"](texts, add_special_tokens=False, verbose=False)["input_ids"]
    if st["eod"] is not None:
        ids = [x + [st["eod"]] for x in ids]
    sizes = [len(x) for x in ids]
    flat = np.fromiter((t for x in ids for t in x), dtype=st["dtype"], count=sum(sizes))
    return flat.tobytes(), sizes


def _chunks(docs: Iterator[str]) -> Iterator[List[str]]:
    chunk, chars = [], 0
    for d in docs:
        chunk.append(d)
        chars += len(d)
        if chars >= CHUNK_CHARS or len(chunk) == CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def preprocess(
    inputs,
    output_prefix: str,
    tokenizer_path: str,
    text_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    workers: int = 1,
    on_error: str = "fail",
    trust_remote_code: bool = False,
    progress: bool = True,
) -> dict:
    """Tokenize `inputs` into `<output_prefix>.bin/.idx/.json`; returns the metadata written to the json.

    Output appears only when complete: temporary names are renamed at the end, and removed on error.
    """
    from tqdm import tqdm

    files = expand_inputs(inputs)
    vocab_size = tokenizer_vocab_size(str(tokenizer_path))
    dtype = dtype_for_vocab(vocab_size)
    init_args = (str(tokenizer_path), trust_remote_code, append_eod, dtype.str)
    skipped: dict = {}
    docs = iter_documents(files, list(text_keys), on_error, skipped)
    setup_start = time.perf_counter()
    num_docs = num_tokens = 0
    pool = None
    try:
        with IndexedDatasetWriter(output_prefix, dtype) as writer:
            # fork where the platform has it: workers inherit the loaded tokenizer instead of each
            # importing transformers and loading it again, which costs more than a small corpus.
            fork = "fork" in mp.get_all_start_methods()
            if workers == 1 or fork:
                _init_worker(*init_args)
            if workers > 1:
                ctx = mp.get_context("fork" if fork else "spawn")
                pool = ctx.Pool(workers) if fork else ctx.Pool(workers, _init_worker, init_args)
                results = pool.imap(_encode_chunk, _chunks(docs))
            else:
                results = map(_encode_chunk, _chunks(docs))
            start = time.perf_counter()
            bar = tqdm(total=None, unit=" docs", disable=not progress, desc="preprocess")
            for data, sizes in results:
                writer.add_raw(data, sizes)
                num_docs += len(sizes)
                num_tokens += sum(sizes)
                bar.update(len(sizes))
                bar.set_postfix(tokens=num_tokens)
            bar.close()
            if num_docs == 0:
                raise UserError(f"data.input={inputs}: no documents were read — check data.text_key and the files")
            seconds = time.perf_counter() - start
            tok = _worker_state.get("tok") or load_tokenizer(str(tokenizer_path), trust_remote_code)
            meta = {
                "tokenizer": str(Path(tokenizer_path).resolve()),
                "tokenizer_class": type(tok).__name__,
                "vocab_size": vocab_size,
                "eod_token_id": eod_token_id(tok) if append_eod else None,
                "dtype": dtype.name,
                "inputs": files,
                "text_keys": list(text_keys),
                "num_documents": num_docs,
                "num_tokens": num_tokens,
                "skipped": skipped,
                "setup_seconds": round(start - setup_start, 3),  # tokenizer loading, worker start
                "seconds": round(seconds, 3),  # reading, tokenizing and writing
                "tokens_per_second": round(num_tokens / max(seconds, 1e-9), 1),
            }
            Path(output_prefix + ".json.tmp").write_text(json.dumps(meta, indent=2) + "\n")
            writer.finalize()
            os.replace(output_prefix + ".json.tmp", output_prefix + ".json")
    except OSError as e:  # the inputs are read behind reading(): this is the output (a full disk, a read-only place)
        raise UserError(f"data.output_prefix={output_prefix}: writing failed ({e.strerror or e}); free space there "
                        "or choose another data.output_prefix") from None
    finally:
        if pool is not None:
            pool.terminate()
        if os.path.exists(output_prefix + ".json.tmp"):
            os.remove(output_prefix + ".json.tmp")
    return meta
