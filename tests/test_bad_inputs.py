"""Bad input of every kind ends in one line naming the key or file, never a traceback, never a lost input.

Most cases run `launch()` in this process on a composed config (what launch.py does after Hydra), building
their bad files in tmp_path; a few run launch.py as a user would, to prove the whole path end to end.
"""

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from speedllm.config import register_configs
from speedllm.config.schema import ASSETS, ROOT
from speedllm.launcher import launch

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
# A small qwen3_tiny (demo tokenizer's 8192 vocabulary) so checkpoints are cheap to write and copy.
SMALL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=1", "model.head_dim=8"]


def composed(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=list(overrides))


def run_inprocess(tmp_path, capsys, *overrides):
    """launch() on the composed config; returns (status, stdout, stderr)."""
    cfg = composed(f"run_dir={tmp_path / 'run'}", "logging.progress_bar=false", "logging.tensorboard=false",
                   *overrides)
    status = launch(cfg)
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_failure(status, out, err, names, code=2):
    assert status == code, (status, out, err)
    assert "Traceback" not in out + err
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
    cfg = composed(f"run_dir={root}", *SMALL)
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
    ("train.max_bad_steps=0", "train.max_bad_steps"), ("train.loss_chunk_size=0", "train.loss_chunk_size"),
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
    ("data.split=[1,1,1,1]", "data.split"), ("data.split=abc", "data.split"), ("evaluate.steps=0", "evaluate.steps"),
    ("model.num_attention_heads=0", "model.num_attention_heads"), ("model.num_key_value_heads=3", "num_key_value_heads"),
    ("model.hidden_size=-1", "model.hidden_size"), ("model.vocab_size=0", "model.vocab_size"),
    ("model.rms_norm_eps=0", "model.rms_norm_eps"), ("model.num_experts=-1", "model.num_experts"),
    ("model.num_experts=4", "model.num_experts"), ("hardware=cpu hardware.memory_gb=0", "hardware.memory_gb"),
    ("hardware=cpu hardware.dtype=float64", "hardware.dtype"), ("parallel.tp=0", "parallel.tp"),
    ("data.format=bogus", "data.format"), ("train.recompute=most", "train.recompute"),
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
    (_gen("generate.batch_size=0"), "generate.batch_size"),
    (["task=generate"], "generate.prompt"),
    (["task=preprocess"], "data.input"),
    (["task=convert", "convert.to=hf"], "convert.out"),
    (["task=convert", "convert.to=onnx", "convert.out=x"], "convert.to"),
]


@pytest.mark.parametrize("overrides,names", TASK_VALUES, ids=[" ".join(v[0][-2:]) for v in TASK_VALUES])
def test_task_setting_is_refused_in_one_line(overrides, names, tmp_path, capsys):
    assert_one_line_failure(*run_inprocess(tmp_path, capsys, *overrides), names)
