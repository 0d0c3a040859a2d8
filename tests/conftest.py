"""Fixtures shared by the test modules: the launcher as a user runs it, and tiny Qwen3 models in transformers form.

The config is composed with `speedllm.config.compose_config` (the library's own helper). Every test module carries
one group marker, registered in setup.cfg: `unit` (one process, behaviour and exact values), `numerics` (our
numbers against transformers or a single-process run) or `distributed` (several ranks); `slow` marks the long
end-to-end runs. `pytest -m "unit and not slow"` is the quick pass.

Under xdist (`pytest -n 2`, `--dist loadgroup` from setup.cfg) the tests that share a module-scoped fixture (one
multi-rank job, one server, one set of runs) form one group that a single worker runs, so the fixture runs once,
and the groups and the `slow` and `distributed` tests are handed out first (the longest work starts first).
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.models.config import ModelConfig
from speedllm.paths import ASSETS, ROOT

DEMO_TOKENIZER = ASSETS / "tokenizers" / "demo"
# A 2-layer, 32-wide Qwen3 (GQA 4:2 heads of 16): small enough for any test, big enough to exercise every piece.
TINY_MODEL = dict(name="tiny", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rope_theta=5000.0)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    def first(item):  # slow before the rest, distributed before one-process
        return item.get_closest_marker("slow") is None, item.get_closest_marker("distributed") is None

    order = {}  # a group starts where its first test would, so it stays in one piece
    for item in items:
        defs = item._fixtureinfo.name2fixturedefs.values()
        if any(d.scope == "module" for fixturedefs in defs for d in fixturedefs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
            order[item.module] = min(order.get(item.module, first(item)), first(item))
    items.sort(key=lambda item: order.get(item.module, first(item)) if item.get_closest_marker("xdist_group")
               else first(item))


def _launch_argv(run_dir, *overrides) -> list:
    return [sys.executable, str(ROOT / "launch.py"), f"hydra.run.dir={run_dir}", *overrides]


def _launch(run_dir, *overrides, cwd=None, timeout=300) -> tuple:
    run_dir = Path(run_dir)
    cwd = Path(cwd) if cwd is not None else run_dir
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(_launch_argv(run_dir, *overrides), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="session")
def launch():
    """`launch(run_dir, *overrides, cwd=run_dir, timeout=300) -> (exit code, stdout, stderr)`: `python launch.py
    hydra.run.dir=<run_dir> <overrides>` run as a user would, from `cwd`."""
    return _launch


@pytest.fixture(scope="session")
def launch_argv():
    """`launch_argv(run_dir, *overrides)`: the same command line, for a test that starts the process itself."""
    return _launch_argv


def _tiny_model_cfg(**overrides):
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), {**TINY_MODEL, **overrides})


@pytest.fixture(scope="session")
def tiny_model_cfg():
    """`tiny_model_cfg(**overrides)`: the ModelConfig of TINY_MODEL with `overrides` (any ModelConfig field)."""
    return _tiny_model_cfg


def _tiny_hf(cfg, seed):
    """transformers' Qwen3ForCausalLM (Qwen3MoeForCausalLM when cfg has experts) for `cfg`, initialized under `seed`."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from speedllm.models.hf_adapter import hf_config

    torch.manual_seed(seed)
    return (Qwen3MoeForCausalLM if cfg.num_experts else Qwen3ForCausalLM)(hf_config(cfg)).eval()


def _hf_pair(seed=0, ops="reference", **overrides):
    from speedllm.models.hf_adapter import from_hf_state_dict
    from speedllm.models.qwen3 import Qwen3

    cfg = _tiny_model_cfg(**overrides)
    hf = _tiny_hf(cfg, seed)
    ours = Qwen3(cfg, ops=ops).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    return cfg, hf, ours


@pytest.fixture(scope="session")
def hf_pair():
    """`hf_pair(seed=0, ops="reference", **overrides) -> (cfg, transformers model, our Qwen3)`: a random tiny
    transformers model and our model (on op set `ops`) carrying the same weights, both in eval mode."""
    return _hf_pair


def _save_tiny_hf(path, seed=0, tokenizer=True, max_shard_size="5GB", **overrides):
    hf = _tiny_hf(_tiny_model_cfg(**overrides), seed)
    path = Path(path)
    hf.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer:
        for file in DEMO_TOKENIZER.iterdir():
            shutil.copy(file, path / file.name)
    return hf


@pytest.fixture(scope="session")
def save_tiny_hf():
    """`save_tiny_hf(path, seed=0, tokenizer=True, max_shard_size="5GB", **overrides) -> transformers model`: a
    randomly initialized tiny Qwen3 (MoE when `num_experts` is set) saved by transformers' save_pretrained into
    `path`, with the demo tokenizer's files beside it (the model's vocab_size must then cover its 8192 ids)."""
    return _save_tiny_hf


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """`(path, transformers model, demo tokenizer)`: a random tiny Qwen3 (seed 9, tied, the demo tokenizer's
    vocabulary) saved by transformers with the demo tokenizer's files beside it."""
    from speedllm.data.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("hf")
    tok = load_tokenizer(str(DEMO_TOKENIZER))
    hf = _save_tiny_hf(path, seed=9, vocab_size=len(tok), tie_word_embeddings=True)
    return path, hf, tok
