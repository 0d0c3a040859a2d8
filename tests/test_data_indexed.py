"""MMIDIDX format and task=preprocess: spec-level compatibility, round trip, bad input, atomic output."""

import json
import lzma
import struct

import numpy as np
import pytest

from speedllm.data.indexed import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab
from speedllm.data.preprocess import preprocess
from speedllm.errors import UserError
from speedllm.paths import ASSETS

pytestmark = pytest.mark.unit

DEMO_TOK = str(ASSETS / "tokenizers" / "demo")
QWEN_TOK = str(ASSETS / "tokenizers" / "qwen3")

# --- a minimal reader and writer written from the MMIDIDX description, independent of speedllm ---
SPEC_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def spec_read(prefix):
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    (code,) = struct.unpack_from("<B", raw, 17)
    num_seq, num_doc = struct.unpack_from("<QQ", raw, 18)
    pos = 34
    sizes = struct.unpack_from(f"<{num_seq}i", raw, pos)
    pos += 4 * num_seq
    pointers = struct.unpack_from(f"<{num_seq}q", raw, pos)
    pos += 8 * num_seq
    docs = struct.unpack_from(f"<{num_doc}q", raw, pos)
    assert pos + 8 * num_doc == len(raw)
    data = open(prefix + ".bin", "rb").read()
    dt = np.dtype(SPEC_DTYPES[code])
    seqs = [np.frombuffer(data, dt, n, p).tolist() for n, p in zip(sizes, pointers)]
    return version, code, seqs, list(docs)


def spec_write(prefix, seqs, code):
    dt = np.dtype(SPEC_DTYPES[code])
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dt).tobytes())
    sizes = [len(s) for s in seqs]
    pointers = [sum(sizes[:i]) * dt.itemsize for i in range(len(seqs))]
    docs = list(range(len(seqs) + 1))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<QQ", len(seqs), len(docs)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(docs)}q", *docs))


def test_our_writer_read_by_spec_reader(tmp_path):
    seqs = [[1, 2, 3], [], [65535, 0], list(range(100))]
    prefix = str(tmp_path / "ours")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for s in seqs:
            w.add_document(s)
        w.finalize()
    version, code, got, docs = spec_read(prefix)
    assert (version, code) == (1, 8)
    assert got == seqs
    assert docs == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("code", [4, 8])
def test_spec_writer_read_by_our_reader(tmp_path, code):
    seqs = [[5, 6, 7, 8], [9], [40000, 1, 2]]
    prefix = str(tmp_path / "spec")
    spec_write(prefix, seqs, code)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == seqs
    assert ds.get(2, offset=1, length=2).tolist() == [1, 2]
    assert ds.document_indices.tolist() == [0, 1, 2, 3]


def test_dtype_by_vocab():
    assert dtype_for_vocab(8192) == np.uint16 and dtype_for_vocab(151669) == np.int32


def _corpus():
    with lzma.open(ASSETS / "corpus" / "shakespeare.jsonl.xz", "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.mark.parametrize("tok", [DEMO_TOK, QWEN_TOK])
def test_round_trip_every_document(tmp_path, tok):
    from transformers import AutoTokenizer

    texts = [t[:3000] for t in _corpus()[:6]] + ["Über naïve café — 你好，世界\n\tcode = x**2  # 42\n"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
    prefix = str(tmp_path / "out")
    meta = preprocess(str(src), prefix, tok, progress=False)
    ds = IndexedDataset(prefix)
    tokenizer = AutoTokenizer.from_pretrained(tok)
    assert len(ds) == len(texts) == meta["num_documents"]
    assert ds.num_tokens == meta["num_tokens"]
    assert ds.dtype == (np.uint16 if tok == DEMO_TOK else np.int32)
    eod = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for i, text in enumerate(texts):
        ids = ds[i].tolist()
        assert ids[-1] == eod
        assert tokenizer.decode(ids[:-1]) == text


def test_workers_write_identical_files(tmp_path):
    texts = [t[:2000] for t in _corpus()[:40]]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess(str(src), str(tmp_path / "one"), DEMO_TOK, workers=1, progress=False)
    preprocess(str(src), str(tmp_path / "two"), DEMO_TOK, workers=2, progress=False)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()


def test_formats_and_text_keys(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.json").write_text(json.dumps([{"title": "T1", "body": "one"}, {"title": "T2", "body": "two"}]))
    pq.write_table(pa.table({"title": ["T3"], "body": ["three"]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("plain text file")
    meta = preprocess([str(tmp_path / "a.json"), str(tmp_path / "b.parquet")], str(tmp_path / "o"), DEMO_TOK,
                      text_keys=["title", "body"], append_eod=False, progress=False)
    assert meta["num_documents"] == 3 and meta["eod_token_id"] is None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_TOK)
    ds = IndexedDataset(str(tmp_path / "o"))
    assert [tok.decode(ds[i]) for i in range(3)] == ["T1\n\none", "T2\n\ntwo", "T3\n\nthree"]
    meta = preprocess(str(tmp_path / "*.txt"), str(tmp_path / "t"), DEMO_TOK, progress=False)
    assert meta["num_documents"] == 1


BAD_LINES = [
    (b'{"text": "fine"}\n', None),
    (b'{"text": "broken\n', "malformed JSON"),
    (b'{"other": "no text key"}\n', "missing key"),
    (b'{"text": "bad \xff byte"}\n', "invalid UTF-8"),
]
WHITESPACE_ONLY = b'{"text": "   "}\n'  # skipped and counted whatever data.on_error says


@pytest.mark.parametrize("bad", range(1, len(BAD_LINES)))
def test_bad_input_fails_with_file_and_line(tmp_path, bad):
    src = tmp_path / "in.jsonl"
    src.write_bytes(BAD_LINES[0][0] + BAD_LINES[bad][0])
    prefix = str(tmp_path / "out")
    with pytest.raises(UserError) as e:
        preprocess(str(src), prefix, DEMO_TOK, progress=False)
    msg = str(e.value)
    assert msg.startswith(f"{src}:2: {BAD_LINES[bad][1]}") and "\n" not in msg
    assert not list(tmp_path.glob("out*")), "no partial output may remain"


def test_bad_input_skip_counts(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(line for line, _ in BAD_LINES) + WHITESPACE_ONLY + BAD_LINES[0][0])
    meta = preprocess(str(src), str(tmp_path / "out"), DEMO_TOK, on_error="skip", progress=False)
    assert meta["num_documents"] == 2
    assert meta["skipped"] == {"malformed JSON line": 1, "missing key text": 1, "invalid UTF-8": 1, "empty document": 1}
    assert json.loads((tmp_path / "out.json").read_text())["skipped"] == meta["skipped"]


def test_failed_rewrite_keeps_no_half_pair(tmp_path):
    """A failing run over an existing prefix never leaves the new .bin next to the old .idx."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "good"}\n')
    prefix = str(tmp_path / "out")
    preprocess(str(src), prefix, DEMO_TOK, progress=False)
    before = (tmp_path / "out.bin").read_bytes(), (tmp_path / "out.idx").read_bytes()
    src.write_text('{"text": "good"}\n{"text": \n')
    with pytest.raises(UserError):
        preprocess(str(src), prefix, DEMO_TOK, progress=False)
    assert ((tmp_path / "out.bin").read_bytes(), (tmp_path / "out.idx").read_bytes()) == before
    assert sorted(p.name for p in tmp_path.glob("out*")) == ["out.bin", "out.idx", "out.json"]


def test_task_preprocess_from_composed_config(tmp_path, capsys):
    from speedllm.config import compose_config
    from speedllm.tasks import preprocess as task

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "To be, or not to be"}\n{"text": "that is the question"}\n')
    cfg = compose_config("task=preprocess", f"data.input={src}", f"data.output_prefix={tmp_path}/corpus",
                         f"data.tokenizer={QWEN_TOK}", "logging.progress_bar=false")
    meta = task.run(cfg)
    assert meta["num_documents"] == 2 and meta["dtype"] == "int32"
    assert "tokens/s" in capsys.readouterr().out
    assert IndexedDataset(str(tmp_path / "corpus"))[1].tolist()[-1] == 151643


def test_empty_documents_are_skipped_and_counted(tmp_path, capsys):
    """1% empty or whitespace-only documents: the same tokens as the clean corpus, and the count reported."""
    from omegaconf import OmegaConf

    from speedllm.tasks.preprocess import run

    docs = [f"document {i}: " + "to be or not to be " * (i % 7 + 1) for i in range(297)]
    noisy = list(docs)
    for at, blank in ((10, ""), (150, "   "), (290, "\n\t \n")):
        noisy.insert(at, blank)
    for name, corpus in (("clean", docs), ("noisy", noisy)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus))
    preprocess(str(tmp_path / "clean.jsonl"), str(tmp_path / "clean"), DEMO_TOK, progress=False)
    cfg = OmegaConf.create({"data": {"input": str(tmp_path / "noisy.jsonl"), "output_prefix": str(tmp_path / "noisy"),
                                     "tokenizer": DEMO_TOK, "text_key": ["text"], "append_eod": True, "workers": 1,
                                     "on_error": "fail", "trust_remote_code": False,
                                     "cache_dir": str(tmp_path / "cache")},
                            "logging": {"progress_bar": False}})
    meta = run(cfg)
    assert meta["skipped"] == {"empty document": 3} and meta["num_documents"] == 297
    clean, noisy_ds = IndexedDataset(str(tmp_path / "clean")), IndexedDataset(str(tmp_path / "noisy"))
    assert len(clean) == len(noisy_ds) == 297
    assert all(np.array_equal(clean[i], noisy_ds[i]) for i in range(297))
    summary = capsys.readouterr().out
    assert "read 300 records, wrote 297 documents" in summary and "skipped 3 (3 empty document)" in summary
