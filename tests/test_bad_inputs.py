"""Bad input of every kind ends in one line naming the key or file, never a traceback, never a lost input.

Most cases run `launch()` in this process on a composed config (what launch.py does after Hydra), building
their bad files in tmp_path; a few run launch.py as a user would, to prove the whole path end to end.
"""

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.config import compose_config
from speedllm.launcher import launch
from speedllm.paths import ASSETS, ROOT

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
# A small qwen3_tiny (demo tokenizer's 8192 vocabulary) so checkpoints are cheap to write and copy.
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1", "model.head_dim=8"]


def run_inprocess(tmp_path, capsys, *overrides):
    """launch() on the composed config; returns (status, stdout, stderr)."""
    cfg = compose_config(f"run_dir={tmp_path / 'run'}", "logging.progress_bar=false", "logging.tensorboard=false",
                   *overrides)
    status = launch(cfg)
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_failure(status, out, err, names, code=2):
    assert status == code, (status, out, err)
    assert "Traceback" not in out + err and "internal error" not in out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and names in last, last


def tree_hash(path: Path) -> str:
    """Hash of a file, or of every file (name and bytes) under a directory."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real (small) training checkpoint root written by save_checkpoint."""
    from speedllm.checkpoint.dcp import save_checkpoint
    from speedllm.models.qwen3 import Qwen3

    root = tmp_path_factory.mktemp("ckpt")
    cfg = compose_config(f"run_dir={root}", *SMALL, "model.max_position_embeddings=64")
    OmegaConf.resolve(cfg)
    model = Qwen3(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(str(root / "checkpoints"), 1, model, optimizer, {"step": 1}, cfg, keep=0)
    return root / "checkpoints"


@pytest.fixture
def ckpt(checkpoint, tmp_path):
    """A private copy of the checkpoint root (cases damage it)."""
    return Path(shutil.copytree(checkpoint, tmp_path / "checkpoints"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny transformers Qwen3 saved with save_pretrained, with the demo tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("hf") / "tiny"
    config = Qwen3Config(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)
    for f in DEMO_TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture
def hf(hf_dir, tmp_path):
    return Path(shutil.copytree(hf_dir, tmp_path / "hf"))


def _gen(*extra):
    return ["task=generate", "generate.prompt=Hi", "generate.max_new_tokens=2", *extra]


# ------------------------------------------------------------------------------ config values

VALUES = [
    ("train.steps=-1", "train.steps"), ("train.steps=0", "train.steps"), ("train.seq_len=-1", "train.seq_len"),
    ("train.seq_len=0", "train.seq_len"), ("train.micro_batch_size=0", "train.micro_batch_size"),
    ("train.micro_batch_size=-2", "train.micro_batch_size"), ("train.global_batch_size=0", "train.global_batch_size"),
    ("train.log_every=0", "train.log_every"), ("train.eval_steps=0", "train.eval_steps"),
    ("train.max_bad_steps=0", "train.max_bad_steps"), ("train.loss_chunk_size=-1", "train.loss_chunk_size"),
    ("train.eval_every=-1", "train.eval_every"), ("train.grad_clip=-1", "train.grad_clip"),
    ("train.stop_after=-1", "train.stop_after"), ("optim.lr=0", "optim.lr"), ("optim.lr=-1e-3", "optim.lr"),
    ("optim.lr=nan", "optim.lr"), ("optim.lr=inf", "optim.lr"), ("optim.min_lr=-1", "optim.min_lr"),
    ("optim.min_lr=1", "optim.min_lr"), ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("optim.eps=-1e-8", "optim.eps"), ("optim.betas=[0.9,1.0]", "optim.betas"), ("optim.betas=[-0.1,0.9]", "optim.betas"),
    ("optim.betas=[0.9]", "optim.betas"), ("optim.warmup_steps=-5", "optim.warmup_steps"),
    ("optim.decay_fraction=2", "optim.decay_fraction"), ("optim.schedule=bogus", "optim.schedule"),
    ("checkpoint.every=-1", "checkpoint.every"), ("launcher.nnodes=0", "launcher.nnodes"),
    ("launcher.nnodes=-1", "launcher.nnodes"), ("launcher.nproc_per_node=-1", "launcher.nproc_per_node"),
    ("launcher.node_rank=-1", "launcher.node_rank"), ("launcher.node_rank=3", "launcher.node_rank"),
    ("launcher.max_restarts=-1", "launcher.max_restarts"), ("launcher.monitor_interval=0", "launcher.monitor_interval"),
    ("launcher.rdzv_backend=bogus", "launcher.rdzv_backend"), ("launcher.rdzv_timeout=0", "launcher.rdzv_timeout"),
    ("data.workers=0", "data.workers"), ("data.loader_workers=-1", "data.loader_workers"),
    ("data.split=[nan,1,1]", "data.split"), ("data.split=[0,0,0]", "data.split"), ("data.split=[1,-1,0]", "data.split"),
    ("data.split=[1,1,1,1]", "data.split"), ("data.split=abc", "data.split"),
    ("model.num_attention_heads=0", "model.num_attention_heads"), ("model.num_key_value_heads=3", "num_key_value_heads"),
    ("model.hidden_size=-1", "model.hidden_size"), ("model.vocab_size=0", "model.vocab_size"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps"), ("model.num_experts=-1", "model.num_experts"),
    ("model.num_experts=4", "model.num_experts"), ("hardware=cpu hardware.memory_gb=0", "hardware.memory_gb"),
    ("hardware=cpu hardware.dtype=float64", "hardware.dtype"), ("parallel.tp=0", "parallel.tp"),
    ("data.format=bogus", "data.format"), ("train.recompute=most", "train.recompute"),
    # a dtype the device profile has no kernels for; a task.name the task group lacks; keys `+` sneaks past the schema
    ("hardware=cpu hardware.dtype=float16", "hardware.dtype"), ("task.name=pretrian", "task.name"),
    ("task.name=generate", "task.name"), ("+foo=1", "foo"), ("+train.stepz=3", "train.stepz"),
]


@pytest.mark.parametrize("override,names", VALUES, ids=[v[0] for v in VALUES])
def test_config_value_is_refused_in_one_line(override, names, tmp_path, capsys):
    status, out, err = run_inprocess(tmp_path, capsys, *override.split())
    assert_one_line_failure(status, out, err, names)
    assert not (tmp_path / "run").exists()  # a refused config leaves no run directory


TASK_VALUES = [
    (["task=plan", "plan.top=0"], "plan.top"),
    (["task=plan", "plan.compute_efficiency=1.5"], "plan.compute_efficiency"),
    (["task=plan", "plan.memory_margin=1"], "plan.memory_margin"),
    (_gen("generate.max_new_tokens=0"), "generate.max_new_tokens"),
    (_gen("generate.top_p=0"), "generate.top_p"),
    (_gen("generate.temperature=-1"), "generate.temperature"),
    (_gen("generate.temperature=1e-9"), "generate.temperature"),  # logits / 1e-9 overflow float32
    (_gen("generate.batch_size=0"), "generate.batch_size"),
    (["task=generate"], "generate.prompt"),
    (["task=evaluate", "evaluate.steps=0"], "evaluate.steps"),
    (["task=preprocess"], "data.input"),
    (["task=convert", "convert.to=hf"], "convert.out"),
    (["task=convert", "convert.to=onnx", "convert.out=x"], "convert.to"),
]


@pytest.mark.parametrize("overrides,names", TASK_VALUES, ids=[" ".join(v[0][-2:]) for v in TASK_VALUES])
def test_task_setting_is_refused_in_one_line(overrides, names, tmp_path, capsys):
    assert_one_line_failure(*run_inprocess(tmp_path, capsys, *overrides), names)


# ------------------------------------------------------------------------------------- files
# Each builder makes its bad input under tmp (with the shared fixtures) and returns (overrides, names-in-the-line).

def _write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
    return path


def _dataset(tmp, name="d"):
    """A real .bin/.idx pair of 20 documents, written by our writer."""
    import numpy as np

    from speedllm.data.indexed import IndexedDatasetWriter

    prefix = str(tmp / name)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for i in range(20):
            writer.add_document(np.arange(50, dtype=np.uint16) + i)
        writer.finalize()
    return prefix


def _pretrain_on(prefix):
    return [f"data.path={prefix}", f"data.tokenizer={DEMO_TOKENIZER}", "train.steps=1", *SMALL]


def data_truncated_idx(tmp, **_):
    prefix = _dataset(tmp)
    idx = Path(prefix + ".idx")
    idx.write_bytes(idx.read_bytes()[:60])
    return _pretrain_on(prefix), "d.idx"


def data_garbage_idx(tmp, **_):
    prefix = _dataset(tmp)
    Path(prefix + ".idx").write_bytes(b"not an index at all" * 10)
    return _pretrain_on(prefix), "d.idx"


def data_empty_idx(tmp, **_):
    prefix = _dataset(tmp)
    Path(prefix + ".idx").write_bytes(b"")
    return _pretrain_on(prefix), "d.idx"


def data_short_bin(tmp, **_):
    prefix = _dataset(tmp)
    binf = Path(prefix + ".bin")
    binf.write_bytes(binf.read_bytes()[:100])
    return _pretrain_on(prefix), "d.bin"


def data_missing_bin(tmp, **_):
    prefix = _dataset(tmp)
    os.remove(prefix + ".bin")
    return _pretrain_on(prefix), "data.path"


def data_tokens_past_vocab(tmp, **_):
    import numpy as np

    from speedllm.data.indexed import IndexedDatasetWriter

    prefix = str(tmp / "big")
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for _ in range(20):
            writer.add_document(np.full(50, 100_000, dtype=np.int32))
        writer.finalize()
    return _pretrain_on(prefix), "data.path"


def data_blend_odd_list(tmp, **_):
    prefix = _dataset(tmp)
    return [f"data.path=[1.0,{prefix},2.0]", f"data.tokenizer={DEMO_TOKENIZER}", *SMALL], "data.path"


def _preprocess(inp, prefix=None, *extra):
    return ["task=preprocess", f"data.input={inp}", f"data.output_prefix={prefix or Path(inp).parent / 'out'}",
            f"data.tokenizer={DEMO_TOKENIZER}", *extra]


def corpus_corrupt_gzip(tmp, **_):
    return _preprocess(_write(tmp / "c.jsonl.gz", b"\x1f\x8b\x08\x00garbage-not-gzip")), "c.jsonl.gz"


def corpus_parquet_mislabelled(tmp, **_):
    return _preprocess(_write(tmp / "c.parquet", '{"text": "a"}\n')), "c.parquet"


def corpus_json_number(tmp, **_):
    return _preprocess(_write(tmp / "c.json", "42")), "c.json"


def corpus_json_strings(tmp, **_):
    return _preprocess(_write(tmp / "c.json", '["a", "b"]')), "c.json"


def corpus_jsonl_array_line(tmp, **_):
    return _preprocess(_write(tmp / "c.jsonl", '{"text": "a"}\n[1, 2]\n')), "c.jsonl:2"


def corpus_jsonl_wrong_key(tmp, **_):
    return _preprocess(_write(tmp / "c.jsonl", '{"body": "a"}\n')), "c.jsonl:1"


def corpus_all_empty(tmp, **_):
    return _preprocess(_write(tmp / "c.jsonl", '{"text": ""}\n{"text": "  "}\n')), "data.input"


def corpus_directory(tmp, **_):
    (tmp / "dir").mkdir()
    return _preprocess(tmp / "dir", tmp / "out"), "data.input"


def corpus_not_utf8(tmp, **_):
    return _preprocess(_write(tmp / "c.txt", b"\xff\xfe\x00bad")), "c.txt"


def corpus_malformed_json(tmp, **_):
    return _preprocess(_write(tmp / "c.json", '[{"text": "a"},')), "c.json"


def corpus_output_under_a_file(tmp, **_):
    inp = _write(tmp / "c.jsonl", '{"text": "a"}\n')
    return _preprocess(inp, _write(tmp / "afile", "x") / "out"), "data.output_prefix"


def corpus_text_key_wrong_type(tmp, **_):
    return _preprocess(_write(tmp / "c.jsonl", '{"text": {"nested": 1}}\n'), None, "data.text_key=[text]"), "c.jsonl:1"


def tokenizer_missing(tmp, **_):
    return [f"data.tokenizer={tmp / 'nope'}"], "data.tokenizer"


def tokenizer_empty_dir(tmp, **_):
    (tmp / "tok").mkdir()
    return [f"data.tokenizer={tmp / 'tok'}"], "data.tokenizer"


def tokenizer_garbage_json(tmp, **_):
    _write(tmp / "tok" / "tokenizer.json", "{ this is not json")
    return [f"data.tokenizer={tmp / 'tok'}"], "tokenizer.json"


def tokenizer_wrong_shape_json(tmp, **_):
    _write(tmp / "tok" / "tokenizer.json", '{"model": 3}')
    return [f"data.tokenizer={tmp / 'tok'}"], "tokenizer.json"


def tokenizer_garbage_config_only(tmp, **_):
    _write(tmp / "tok" / "tokenizer_config.json", "[[[")
    return [f"data.tokenizer={tmp / 'tok'}"], "data.tokenizer"


def tokenizer_is_a_file(tmp, **_):
    return [f"data.tokenizer={_write(tmp / 'tok.json', '{}')}"], "data.tokenizer"


def ckpt_garbage_metadata(tmp, ckpt, **_):
    _write(ckpt / "step_00000001" / ".metadata", b"\x80\x04garbage")
    return _gen(f"checkpoint.load={ckpt}"), ".metadata"


def ckpt_empty_metadata(tmp, ckpt, **_):
    _write(ckpt / "step_00000001" / ".metadata", b"")
    return _gen(f"checkpoint.load={ckpt}"), ".metadata"


def ckpt_truncated_distcp(tmp, ckpt, **_):
    for f in (ckpt / "step_00000001").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:64])
    return _gen(f"checkpoint.load={ckpt}"), "step_00000001"


def ckpt_other_model_size(tmp, ckpt, **_):
    frozen = ckpt / "step_00000001" / "config.yaml"
    frozen.write_text(frozen.read_text().replace("hidden_size: 32", "hidden_size: 64"))
    return _gen(f"checkpoint.load={ckpt}"), "step_00000001"


def ckpt_latest_names_deleted_step(tmp, ckpt, **_):
    (ckpt / "latest").write_text("step_00000099\n")
    return _gen(f"checkpoint.load={ckpt}"), "step_00000099"


def ckpt_latest_names_empty_step(tmp, ckpt, **_):
    (ckpt / "step_00000002").mkdir()
    (ckpt / "latest").write_text("step_00000002\n")
    return _gen(f"checkpoint.load={ckpt}"), "step_00000002"


def ckpt_corrupt_config(tmp, ckpt, **_):
    _write(ckpt / "step_00000001" / "config.yaml", "model: [unclosed\n  - : :")
    return _gen(f"checkpoint.load={ckpt}"), "config.yaml"


def ckpt_config_wrong_shape(tmp, ckpt, **_):
    _write(ckpt / "step_00000001" / "config.yaml", "- just\n- a list\n")
    return _gen(f"checkpoint.load={ckpt}"), "config.yaml"


def ckpt_not_a_checkpoint(tmp, **_):
    (tmp / "empty").mkdir()
    return _gen(f"checkpoint.load={tmp / 'empty'}"), "checkpoint.load"


def ckpt_missing(tmp, **_):
    return _gen(f"checkpoint.load={tmp / 'nowhere'}"), "checkpoint.load"


def ckpt_resume_other_size(tmp, ckpt, **_):
    return ["train.steps=2", f"checkpoint.load={ckpt}", "model.hidden_size=64", "model.head_dim=16",
            "model.intermediate_size=64", "model.num_hidden_layers=1", "generate.num_samples=0"], "step_00000001"


def ckpt_convert_garbage_metadata(tmp, ckpt, **_):
    _write(ckpt / "step_00000001" / ".metadata", b"garbage")
    return ["task=convert", "convert.to=hf", f"checkpoint.load={ckpt}", f"convert.out={tmp / 'o'}"], ".metadata"


def _hf(hf, *extra):
    return _gen("model=hf", f"checkpoint.load_hf={hf}", *extra)


def hf_config_not_json(tmp, hf, **_):
    _write(hf / "config.json", "{oops")
    return _hf(hf), "config.json"


def hf_config_list(tmp, hf, **_):
    _write(hf / "config.json", "[1, 2]")
    return _hf(hf), "config.json"


def hf_config_missing_fields(tmp, hf, **_):
    _write(hf / "config.json", '{"architectures": ["Qwen3ForCausalLM"]}')
    return _hf(hf), "config.json"


def hf_config_wrong_types(tmp, hf, **_):
    config = json.loads((hf / "config.json").read_text())
    config["hidden_size"] = "big"
    _write(hf / "config.json", json.dumps(config))
    return _hf(hf), "config.json"


def hf_unsupported_architecture(tmp, hf, **_):
    config = json.loads((hf / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    _write(hf / "config.json", json.dumps(config))
    return _hf(hf), "checkpoint.load_hf"


def hf_bad_index(tmp, hf, **_):
    _write(hf / "model.safetensors.index.json", "{not json")
    return _hf(hf), "model.safetensors.index.json"


def hf_index_wrong_shape(tmp, hf, **_):
    _write(hf / "model.safetensors.index.json", '{"weights": {}}')
    return _hf(hf), "model.safetensors.index.json"


def hf_index_absent_shard(tmp, hf, **_):
    _write(hf / "model.safetensors.index.json", '{"weight_map": {"lm_head.weight": "gone.safetensors"}}')
    return _hf(hf), "gone.safetensors"


def hf_garbage_shard(tmp, hf, **_):
    _write(hf / "model.safetensors", b"\x00" * 64)
    return _hf(hf), "model.safetensors"


def hf_truncated_shard(tmp, hf, **_):
    f = hf / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    return _hf(hf), "model.safetensors"


def hf_no_weights(tmp, hf, **_):
    os.remove(hf / "model.safetensors")
    return _hf(hf), "checkpoint.load_hf"


def hf_int32_weights(tmp, hf, **_):
    from safetensors.torch import load_file, save_file

    state = load_file(str(hf / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    save_file(state, str(hf / "model.safetensors"))
    return _hf(hf), "model.norm.weight"


def hf_missing_dir(tmp, **_):
    return _gen("model=hf", f"checkpoint.load_hf={tmp / 'nope'}"), "checkpoint.load_hf"


def hf_is_a_file(tmp, **_):
    return _gen("model=hf", f"checkpoint.load_hf={_write(tmp / 'f', 'x')}"), "checkpoint.load_hf"


def _prompts(ckpt, path, *extra):
    return ["task=generate", f"checkpoint.load={ckpt}", f"generate.prompts_file={path}",
            "generate.max_new_tokens=2", *extra]


def prompts_empty(tmp, ckpt, **_):
    return _prompts(ckpt, _write(tmp / "p.txt", "")), "generate.prompts_file"


def prompts_blank_lines(tmp, ckpt, **_):
    return _prompts(ckpt, _write(tmp / "p.txt", "\n  \n\n")), "generate.prompts_file"


def prompts_not_utf8(tmp, ckpt, **_):
    return _prompts(ckpt, _write(tmp / "p.txt", b"\xff\xfe\xfa")), "generate.prompts_file"


def prompts_jsonl_not_json(tmp, ckpt, **_):
    return _prompts(ckpt, _write(tmp / "p.jsonl", "{broken\n")), "generate.prompts_file"


def prompts_jsonl_wrong_type(tmp, ckpt, **_):
    return _prompts(ckpt, _write(tmp / "p.jsonl", '{"prompt": 3}\n')), "generate.prompts_file"


def prompts_directory(tmp, ckpt, **_):
    (tmp / "pd").mkdir()
    return _prompts(ckpt, tmp / "pd"), "generate.prompts_file"


def prompts_missing(tmp, ckpt, **_):
    return _prompts(ckpt, tmp / "none.txt"), "generate.prompts_file"


def output_is_a_directory(tmp, ckpt, **_):
    (tmp / "od").mkdir()
    return _gen(f"checkpoint.load={ckpt}", f"generate.output={tmp / 'od'}"), "generate.output"


def output_under_a_file(tmp, ckpt, **_):
    return _gen(f"checkpoint.load={ckpt}", f"generate.output={_write(tmp / 'f', 'x') / 'o.jsonl'}"), "generate.output"


def convert_out_not_empty(tmp, ckpt, **_):
    _write(tmp / "o" / "mine.txt", "keep me")
    return ["task=convert", "convert.to=hf", f"checkpoint.load={ckpt}", f"convert.out={tmp / 'o'}"], "convert.out"


def convert_out_is_a_file(tmp, ckpt, **_):
    return ["task=convert", "convert.to=hf", f"checkpoint.load={ckpt}",
            f"convert.out={_write(tmp / 'o', 'x')}"], "convert.out"


def convert_bad_dtype(tmp, ckpt, **_):
    return ["task=convert", "convert.to=hf", f"checkpoint.load={ckpt}", f"convert.out={tmp / 'o'}",
            "convert.dtype=int8"], "convert.dtype"


def convert_bad_shard_size(tmp, ckpt, **_):
    return ["task=convert", "convert.to=hf", f"checkpoint.load={ckpt}", f"convert.out={tmp / 'o'}",
            "convert.max_shard_size=lots"], "convert.max_shard_size"


def _sft(path, fmt="messages", *extra):
    return ["task=sft", f"data.input={path}", f"data.format={fmt}", "train.steps=1", *SMALL, *extra]


def sft_content_int(tmp, **_):
    rec = {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}
    return _sft(_write(tmp / "s.jsonl", json.dumps(rec) + "\n")), "s.jsonl:1"


def sft_messages_not_list(tmp, **_):
    return _sft(_write(tmp / "s.jsonl", '{"messages": "hello"}\n')), "s.jsonl:1"


def sft_turn_not_object(tmp, **_):
    return _sft(_write(tmp / "s.jsonl", '{"conversations": ["hi"]}\n'), "sharegpt"), "s.jsonl:1"


def sft_alpaca_wrong_type(tmp, **_):
    return _sft(_write(tmp / "s.json", '[{"instruction": ["a"], "output": "b"}]'), "alpaca"), "s.json"


def sft_wrong_format(tmp, **_):
    rec = {"instruction": "a", "output": "b"}
    return _sft(_write(tmp / "s.jsonl", json.dumps(rec) + "\n"), "messages"), "s.jsonl:1"


def _preprocessed(tmp):
    """A data set written by task=preprocess (its <prefix>.json included)."""
    from speedllm.data.preprocess import preprocess

    corpus = _write(tmp / "c.jsonl", "".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(20)))
    preprocess(str(corpus), str(tmp / "p"), str(DEMO_TOKENIZER), ["text"], True, 1, "fail", progress=False)
    return str(tmp / "p")


def data_meta_truncated(tmp, **_):
    meta = Path(_preprocessed(tmp) + ".json")
    meta.write_text(meta.read_text()[:40])
    return _pretrain_on(str(tmp / "p")), "p.json"


def data_meta_missing_key(tmp, **_):
    meta = Path(_preprocessed(tmp) + ".json")
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "vocab_size"}))
    return _pretrain_on(str(tmp / "p")), "p.json"


def data_cache_under_a_file(tmp, **_):
    return ["train.steps=1", *SMALL, f"data.cache_dir={_write(tmp / 'f', 'x') / 'cache'}"], "data.cache_dir"


RESUME = ["train.steps=2", "train.seq_len=16", "train.global_batch_size=2", "train.micro_batch_size=2",
          "generate.num_samples=0", *SMALL]


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A checkpoint root written by a real one-step training run (model, optimizer, scheduler, loader, RNG)."""
    root = tmp_path_factory.mktemp("trained")
    cfg = compose_config(f"run_dir={root}", "logging.progress_bar=false", "logging.tensorboard=false",
                         *RESUME, "train.steps=1")
    assert launch(cfg) == 0
    return root / "checkpoints"


@pytest.fixture
def trained(trained_checkpoint, tmp_path):
    return Path(shutil.copytree(trained_checkpoint, tmp_path / "trained"))


def ckpt_extra_state_garbled(tmp, trained, **_):
    _write(trained / "step_00000001" / "extra_rank0.pt", b"PK\x03\x04 not a zip at all")
    return [f"checkpoint.load={trained}", *RESUME], "extra_rank0.pt"


def ckpt_extra_state_missing_key(tmp, trained, **_):
    torch.save({"step": 1, "loader": {}}, trained / "step_00000001" / "extra_rank0.pt")
    return [f"checkpoint.load={trained}", *RESUME], "extra_rank"


def ckpt_extra_state_wrong_values(tmp, trained, **_):
    extra = trained / "step_00000001" / "extra_rank0.pt"
    state = torch.load(extra, weights_only=True)
    state["rng"]["python"] = "edited"
    torch.save(state, extra)
    return [f"checkpoint.load={trained}", *RESUME], "extra_rank"


def tokenizer_garbage_config_beside_good_json(tmp, **_):
    tok = Path(shutil.copytree(DEMO_TOKENIZER, tmp / "tok"))
    _write(tok / "tokenizer_config.json", '{"model_max_length": ')
    return [f"data.tokenizer={tok}", "train.steps=1", *SMALL], "tokenizer_config.json"


def corpus_output_prefix_is_a_folder(tmp, **_):
    return _preprocess(_write(tmp / "c.jsonl", '{"text": "a"}\n'), f"{tmp}/out/"), "data.output_prefix"


def output_is_a_folder_name(tmp, ckpt, **_):
    return _gen(f"checkpoint.load={ckpt}", f"generate.output={tmp}/new/"), "generate.output"


def output_device_that_is_full(tmp, ckpt, **_):
    return _gen(f"checkpoint.load={ckpt}", "generate.output=/dev/full"), "generate.output"


FILE_CASES = [f for name, f in sorted(globals().items())
              if name.split("_")[0] in ("data", "corpus", "tokenizer", "ckpt", "hf", "prompts", "output",
                                        "convert", "sft") and callable(f) and not name.startswith("_")
              and "_" in name and f.__module__ == __name__ and name != "hf_dir"]


@pytest.mark.parametrize("build", FILE_CASES, ids=[f.__name__ for f in FILE_CASES])
def test_bad_file_is_refused_in_one_line(build, tmp_path, capsys, request):
    kwargs = {}
    if "ckpt" in build.__code__.co_varnames[:build.__code__.co_argcount]:
        kwargs["ckpt"] = request.getfixturevalue("ckpt")
    if "hf" in build.__code__.co_varnames[:build.__code__.co_argcount]:
        kwargs["hf"] = request.getfixturevalue("hf")
    if "trained" in build.__code__.co_varnames[:build.__code__.co_argcount]:
        kwargs["trained"] = request.getfixturevalue("trained")
    overrides, names = build(tmp_path, **kwargs)
    capsys.readouterr()
    assert_one_line_failure(*run_inprocess(tmp_path, capsys, *overrides), names)


# ------------------------------------------------------------------------------------ security

class _Payload:
    """Unpickling this creates the marker directory: the test of whether a file's code runs."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_planted_metadata_payload_never_runs(ckpt, tmp_path, capsys):
    marker = tmp_path / "pwned"
    (ckpt / "step_00000001" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    for overrides in (_gen(f"checkpoint.load={ckpt}"),
                      ["task=convert", "convert.to=hf", f"checkpoint.load={ckpt}", f"convert.out={tmp_path / 'o'}"],
                      [f"checkpoint.load={ckpt}", *SMALL]):
        assert_one_line_failure(*run_inprocess(tmp_path, capsys, *overrides), ".metadata")
        assert not marker.exists()


def test_planted_payload_in_a_non_tensor_entry_never_runs(tmp_path):
    import torch.distributed.checkpoint as dcp

    from speedllm.checkpoint.dcp import dcp_load
    from speedllm.errors import UserError

    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(2), "extra": _Payload(marker)}, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    state = {"w": torch.zeros(2), "extra": None}
    with pytest.raises(UserError, match="checkpoint entry extra is a pickled object"):
        dcp_load(state, tmp_path / "c")
    assert not marker.exists()
    # plain non-tensor values (an optimizer's param_groups) still load
    dcp.save({"w": torch.ones(2), "extra": {"lr": 0.1, "betas": (0.9, 0.95)}}, checkpoint_id=str(tmp_path / "d"),
             no_dist=True)
    state = {"w": torch.zeros(2), "extra": {"lr": 0.0, "betas": (0.0, 0.0)}}
    dcp_load(state, tmp_path / "d")
    assert state["extra"] == {"lr": 0.1, "betas": (0.9, 0.95)} and torch.equal(state["w"], torch.ones(2))


def test_planted_payload_in_extra_state_never_runs(trained, tmp_path, capsys):
    marker = tmp_path / "pwned"
    extra = trained / "step_00000001" / "extra_rank0.pt"
    state = torch.load(extra, weights_only=True)
    state["loader"] = _Payload(marker)
    torch.save(state, extra)
    status, out, err = run_inprocess(tmp_path, capsys, f"checkpoint.load={trained}", *RESUME)
    assert_one_line_failure(status, out, err, "extra_rank0.pt")
    assert "pickled object" in err and not marker.exists()


# ----------------------------------------------------------------------------- outputs that fail

@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs, filled to its last bytes (needs root: mount)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        with open(mount / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 512)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_writes_to_a_full_disk_fail_in_one_line_and_leave_nothing(ckpt, full_disk, tmp_path, capsys):
    before = sorted(p.name for p in full_disk.iterdir())
    corpus = _write(tmp_path / "c.jsonl", "".join(json.dumps({"text": "word " * 500}) + "\n" for _ in range(200)))
    for overrides, names in [
        (_gen(f"checkpoint.load={ckpt}", f"generate.output={full_disk / 'o.jsonl'}"), "generate.output"),
        (_preprocess(corpus, full_disk / "corpus"), "data.output_prefix"),
    ]:
        status, out, err = run_inprocess(tmp_path, capsys, *overrides)
        assert_one_line_failure(status, out, err, names)
        assert "No space left on device" in err and "wrote" not in out + err
        assert sorted(p.name for p in full_disk.iterdir()) == before  # no half-written output, no temp file


def test_kernel_cache_that_cannot_be_written_falls_back(tmp_path, monkeypatch):
    from speedllm import native
    from speedllm.ops.cpu import KERNEL_SOURCE

    monkeypatch.setenv("XDG_CACHE_HOME", str(_write(tmp_path / "a-file", "x")))
    with pytest.warns(UserWarning, match="cannot be written|not built"):
        library = native.load.__wrapped__(KERNEL_SOURCE, native.isa())
    assert library is None or library.swiglu_fwd  # built for this run only, or the reference twin runs
    assert (tmp_path / "a-file").read_text() == "x"


# ------------------------------------------------------------------------------ input preservation

def _collisions(tmp, ckpt, hf):
    """(overrides, the inputs that must stay byte-identical, names) for each output that would hit an input."""
    corpus = _write(tmp / "corpus" / "docs.json", json.dumps([{"text": "a b c"}] * 3))
    prompts = _write(tmp / "prompts.txt", "Hello\nWorld\n")
    return [
        (_preprocess(corpus, corpus.with_suffix("")), [corpus], "data.output_prefix"),
        (["task=generate", f"checkpoint.load={ckpt}", f"generate.prompts_file={prompts}",
          f"generate.output={prompts}"], [prompts, ckpt], "generate.output"),
        (["task=convert", "convert.to=hf", f"checkpoint.load={ckpt}", f"convert.out={ckpt / 'export'}"], [ckpt],
         "convert.out"),
        (["task=convert", "convert.to=dcp", f"checkpoint.load_hf={hf}", f"convert.out={hf / 'dcp'}"], [hf],
         "convert.out"),
        (["task=convert", "convert.to=hf", f"checkpoint.load={ckpt}", f"convert.out={tmp}"], [ckpt, prompts],
         "convert.out"),
    ]


def test_outputs_that_collide_with_inputs_are_refused_and_inputs_kept(ckpt, hf, tmp_path, capsys):
    for overrides, inputs, names in _collisions(tmp_path, ckpt, hf):
        before = [tree_hash(p) for p in inputs]
        assert_one_line_failure(*run_inprocess(tmp_path, capsys, *overrides), names)
        assert [tree_hash(p) for p in inputs] == before, overrides


def test_pruning_and_scratch_dirs_touch_only_our_own_folders(tmp_path):
    from speedllm.checkpoint.dcp import save_checkpoint
    from speedllm.checkpoint.hf import write_hf_dir
    from speedllm.errors import UserError

    root = tmp_path / "ckpts"
    users = _write(root / "step_00000000" / "notes.txt", "my own folder, named like a checkpoint").parent
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3):
        save_checkpoint(str(root), step, model, optimizer, {"step": step}, OmegaConf.create({}), keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000000", "step_00000003"]
    assert (users / "notes.txt").read_text() == "my own folder, named like a checkpoint"

    # a user's folder with the name of a checkpoint being written, or of the HF export's scratch dir: refused
    _write(root / "step_00000004" / "mine.txt", "keep")
    with pytest.raises(UserError, match="not written by SpeedLLM"):
        save_checkpoint(str(root), 4, model, optimizer, {"step": 4}, OmegaConf.create({}), keep=1)
    scratch = _write(tmp_path / ".export.tmp" / "mine.txt", "keep").parent
    with pytest.raises(UserError, match="not made by SpeedLLM"):
        write_hf_dir(str(tmp_path / "export"), None, {}, lambda names: {}, progress=False)
    assert (root / "step_00000004" / "mine.txt").read_text() == "keep" and (scratch / "mine.txt").exists()


# ---------------------------------------------------------------------------------- catch-all

def test_unexpected_error_is_one_line_with_the_traceback_in_launch_log(tmp_path, capsys):
    from speedllm.console import console_log, guarded

    def broken():
        print("step 1 done")
        {}["no such key"]

    with console_log(tmp_path) as log:
        status = guarded(broken, log, tmp_path)
    out, err = capsys.readouterr()
    assert status == 1 and out == "step 1 done\n"
    assert err == (f"internal error: KeyError: 'no such key'; full traceback in {tmp_path / 'launch.log'}; "
                   "please report it\n")
    logged = (tmp_path / "launch.log").read_text()
    assert logged.startswith("step 1 done\n") and "Traceback" in logged and 'in broken' in logged


# ------------------------------------------------------------------------------------- end to end

def _launch_py(launch_py, tmp, *overrides):
    proc = launch_py([f"hydra.run.dir={tmp / 'run'}", *overrides], tmp)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_launch_py_bad_inputs_end_to_end(ckpt, tmp_path, launch_py):
    """Through launch.py: exit 2, one line, no traceback, no run directory; a planted payload never runs; an
    unresolvable rendezvous host fails at once."""
    marker = tmp_path / "pwned"
    (ckpt / "step_00000001" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    cases = [
        (["train.steps=-1"], "train.steps"),
        (_gen(f"checkpoint.load={ckpt}"), ".metadata"),
        (["parallel=dp2", "launcher.nnodes=2", "launcher.nproc_per_node=1", "task=doctor",
          "launcher.rdzv_endpoint=no-such-host.invalid:29500"], "launcher.rdzv_endpoint"),
    ]
    for overrides, names in cases:
        status, out, err = _launch_py(launch_py, tmp_path, *overrides)
        assert_one_line_failure(status, out, err, names)
        assert not (tmp_path / "run").exists()
    assert not marker.exists()


@pytest.mark.slow
def test_launch_py_command_line_mistakes(tmp_path, launch_py):
    """What Hydra refuses before our code runs: one line naming the override and the fix, exit 2."""
    run_file = _write(tmp_path / "a-file", "x")
    cases = [
        (["train.steps=abc"], "train.steps: Value 'abc' of type 'str' could not be converted to Integer"),
        (["optim.betas=abc"], "optim.betas"),
        (["task=preprocess", "data.input=/tmp/dätä.txt"], """'data.input="/tmp/dätä.txt"'"""),
        (["task=generate", "generate.prompt=two", "words"], "'words' is not an override"),
        (["task=generate", "generate.prompt=a[b"], "generate.prompt=a[b"),
        (["task=pretrian"], "task=pretrian is not an option; choose task=<chat|"),
        (["train.stepz=3"], "train.stepz is not a setting"),
        ([f"hydra.run.dir={run_file}"], f"hydra.run.dir: cannot create the run directory {run_file}"),
    ]
    for overrides, names in cases:
        status, out, err = _launch_py(launch_py, tmp_path, *overrides)
        assert_one_line_failure(status, out, err, names)
        assert len(err.strip().splitlines()) == 1, err
    assert run_file.read_text() == "x" and not (tmp_path / "run").exists()


BLOCKER = """
import runpy, sys
class Blocker:  # as if `pip install` had left these packages out
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Blocker())
sys.argv = [{launch!r}, *sys.argv[1:]]
runpy.run_path({launch!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_a_choice_whose_extra_is_missing_is_refused_before_launch(ckpt, tmp_path):
    """On the base install (the extras' packages hidden from the import system), each choice names its pip line."""
    code = BLOCKER.format(blocked={"torchao", "fastapi", "uvicorn", "lm_eval"}, launch=str(ROOT / "launch.py"))
    cases = [
        (_gen(f"checkpoint.load={ckpt}", "quant=int8_wo"), "quant=int8_wo needs torchao", "[quant]"),
        (["task=sft", "finetune=qlora", "train.steps=1", *SMALL],
         "finetune=qlora needs torchao", "[finetune]"),
        (["task=serve", f"checkpoint.load={ckpt}"], "task=serve needs fastapi", "[serve]"),
        (["task=evaluate", f"checkpoint.load={ckpt}", "evaluate.tasks=[arc_easy]"], "evaluate.tasks needs lm_eval",
         "[eval]"),
    ]
    for overrides, names, extra in cases:
        proc = subprocess.run([sys.executable, "-c", code, f"hydra.run.dir={tmp_path / 'run'}", *overrides],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert_one_line_failure(proc.returncode, proc.stdout, proc.stderr, names)
        assert f"pip install 'speedllm{extra}'" in proc.stderr and "run dir:" not in proc.stdout


@pytest.mark.slow
def test_sigterm_to_a_spawned_job_is_a_clean_stop(tmp_path):
    """SIGTERM to launch.py while its ranks train under the elastic agent: the ranks save and stop, one line,
    exit 0 (as a single-process run stops on SIGTERM)."""
    import signal
    import time

    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run}", "parallel=dp2",
                             "hardware=cpu", "train.steps=100000", "train.log_every=1", "logging.progress_bar=false",
                             *SMALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not ((run / "launch.log").is_file()
                                               and "step" in (run / "launch.log").read_text()):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert err.strip().splitlines()[-1] == "stopped by SIGTERM"
    assert "internal error" not in err and "Traceback" not in err
    assert "SIGTERM: saving a checkpoint" in (run / "launch.log").read_text()


# ------------------------------------------------------------------------------- realistic input

def test_prompt_dash_reads_stdin(monkeypatch):
    import io

    from speedllm.tasks.generate import read_prompts

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello, world\nsecond line\n"))
    assert read_prompts(compose_config("task=generate", "generate.prompt=-").generate) == ["Hello, world\nsecond line"]


def test_generation_past_the_trained_context_says_so(ckpt, tmp_path, capsys):
    status, out, err = run_inprocess(tmp_path, capsys, "task=generate", "generate.prompt=Hi",
                                     "generate.max_new_tokens=70", f"checkpoint.load={ckpt}")
    assert status == 0
    said = re.search(r"goes past the 64 positions the model takes \(model.max_position_embeddings\); its "
                     r"completion stops after (\d+) new tokens", err)
    assert said and 0 < int(said.group(1)) < 64, err


def test_training_only_rules_do_not_apply_to_inference():
    from speedllm.config.validate import check_batch
    from speedllm.errors import UserError

    check_batch(compose_config("task=generate", "generate.prompt=x", "train.seq_len=8192"))  # past 4096 positions: fine
    with pytest.raises(UserError, match="train.seq_len=8192 exceeds max_position_embeddings=4096"):
        check_batch(compose_config("train.seq_len=8192"))


def test_plan_with_demo_sizes_on_a_big_model_says_what_to_pass():
    from speedllm.tasks.plan import demo_sized_note

    note = demo_sized_note(compose_config("task=plan", "model=qwen3_8b"))
    assert "train.seq_len=128" in note and "train.seq_len=4096 train.global_batch_size=1024" in note
    assert demo_sized_note(compose_config("task=plan")) is None  # the demo model with the demo sizes
    assert demo_sized_note(compose_config("task=plan", "model=qwen3_8b", "train.seq_len=4096")) is None
