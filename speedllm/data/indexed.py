"""Megatron's MMIDIDX indexed dataset: a `<prefix>.bin` of token ids and a `<prefix>.idx` index.

Layout of `.idx` (little endian), as written by Megatron-LM's `megatron/core/datasets/indexed_dataset.py`:

    b"MMIDIDX\\x00\\x00"           9-byte header
    <Q version = 1
    <B dtype code                  (DTYPE_CODES below)
    <Q sequence_count              number of sequences (we write one per document)
    <Q document_count              len(document_indices) = documents + 1
    int32[sequence_count]          sequence lengths in tokens
    int64[sequence_count]          byte offset of each sequence in `.bin`
    int64[document_count]          document boundaries as sequence indices, starting with 0

`.bin` is the token ids of all sequences back to back in that dtype. Files written here are complete
or absent: the writer fills temporary names and renames them in place only on `finalize()`.
"""

import os
import struct
from pathlib import Path
from typing import List, Optional

import numpy as np

from speedllm.errors import UserError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when every id fits below 65500, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def exists(prefix: str) -> bool:
    """True when both `<prefix>.bin` and `<prefix>.idx` exist."""
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


class IndexedDataset:
    """Read-only, memory-mapped view of a `.bin/.idx` pair; `ds[i]` is sequence i as a numpy array."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        rewrite = "rewrite the pair with task=preprocess"
        if os.path.getsize(prefix + ".idx") < 34:
            raise UserError(f"{prefix}.idx: too short for an MMIDIDX index (truncated?) — {rewrite}")
        idx = np.memmap(prefix + ".idx", mode="r", dtype=np.uint8)
        if bytes(idx[:9]) != HEADER:
            raise UserError(
                f"{prefix}.idx: not an MMIDIDX index (bad header) — give the prefix of a Megatron .bin/.idx pair"
            )
        version, code, num_seqs, num_docs = struct.unpack("<QBQQ", bytes(idx[9:34]))
        if version != VERSION or code not in DTYPE_CODES:
            raise UserError(
                f"{prefix}.idx: unsupported version {version} or dtype code {code} — rewrite it with task=preprocess"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        offset = 34
        if len(idx) < offset + num_seqs * 12 + num_docs * 8:
            raise UserError(f"{prefix}.idx: holds {len(idx)} bytes but its header promises {num_seqs} sequences and "
                            f"{num_docs} documents (truncated?) — {rewrite}")
        self.sizes = np.frombuffer(idx, np.int32, num_seqs, offset)
        offset += self.sizes.nbytes
        self.pointers = np.frombuffer(idx, np.int64, num_seqs, offset)
        offset += self.pointers.nbytes
        self.document_indices = np.frombuffer(idx, np.int64, num_docs, offset)
        self._idx = idx
        # np.memmap refuses empty files; a corpus of empty documents has an empty `.bin`.
        bin_size = os.path.getsize(prefix + ".bin")
        end = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if num_seqs else 0
        if bin_size < end:
            raise UserError(f"{prefix}.bin: holds {bin_size} bytes but {prefix}.idx indexes {end} (truncated, or "
                            f"not the .idx's pair) — {rewrite}")
        self._bin = np.zeros(0, np.uint8) if bin_size == 0 else np.memmap(prefix + ".bin", mode="r", dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of sequence i (to its end when length is None)."""
        if length is None:
            length = int(self.sizes[i]) - offset
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))


class IndexedDatasetWriter:
    """Append documents, then `finalize()`; until then only `<prefix>.bin.tmp` / `.idx.tmp` exist.

    Use as a context manager: on an exception the temporary files are removed, so a failed run never
    leaves a `.bin/.idx` pair that looks complete.
    """

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(prefix + ".bin.tmp", "wb")
        self._sizes: List[int] = []
        self._doc_indices: List[int] = [0]

    def add_document(self, tokens) -> None:
        """Write one document as one sequence."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(len(arr))
        self._doc_indices.append(len(self._sizes))

    def add_raw(self, data: bytes, sizes: List[int]) -> None:
        """Append already-encoded tokens (bytes in this dtype) of whole documents with these lengths."""
        self._bin.write(data)
        for n in sizes:
            self._sizes.append(n)
            self._doc_indices.append(len(self._sizes))

    def finalize(self) -> None:
        """Write the index and move both files to their final names (the `.idx` last)."""
        self._bin.close()
        sizes = np.asarray(self._sizes, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self.prefix + ".idx.tmp", "wb") as f:
            f.write(HEADER)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(self._doc_indices)))
            f.write(sizes.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self._doc_indices, dtype=np.int64).tobytes(order="C"))
        # Drop an older index first so that no moment pairs it with the new `.bin`.
        if os.path.exists(self.prefix + ".idx"):
            os.remove(self.prefix + ".idx")
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")

    def abort(self) -> None:
        """Drop the temporary files."""
        self._bin.close()
        for suffix in (".bin.tmp", ".idx.tmp"):
            if os.path.exists(self.prefix + suffix):
                os.remove(self.prefix + suffix)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
