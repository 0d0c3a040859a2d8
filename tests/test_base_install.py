"""Every task on the README's base install: with the optional packages made unimportable (a meta-path hook in
sitecustomize, so no second venv), each task runs, or is refused before it starts in one line naming the extra."""

import json
import os
import subprocess
import sys

import pytest

from speedllm.paths import ROOT

pytestmark = pytest.mark.unit

# the extras of setup.cfg (and what they pull in), as imported
EXTRAS = {"torchao", "peft", "lm_eval", "fastapi", "uvicorn", "starlette", "pydantic", "submitit", "hydra_plugins",
          "torch_npu", "openai", "tiktoken", "httpx", "torchtitan", "triton", "s3fs", "moto", "trl"}


def base_install() -> set:
    """Import names of the distributions the base install pulls in (speedllm's requirements without extras, and
    theirs): an extra's package the base needs anyway (httpx, for huggingface_hub) is there without the extra."""
    import re
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    seen, todo = set(), [r for r in distribution("speedllm").requires or []]
    while todo:
        req = Requirement(todo.pop())
        name = re.sub(r"[-_.]+", "_", req.name).lower()
        if name in seen or req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        seen.add(name)
        try:
            todo += distribution(name).requires or []
        except PackageNotFoundError:
            pass
    return seen


# hidden from every finder: find_spec says "not installed"
HIDE = """
import sys

EXTRAS = %r


class Hidden:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in EXTRAS or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
"""

# every task in this one process (launch(), as launch.py calls it), tiny and short; one JSON line each
RUN = """
import importlib.util, io, json, sys
from pathlib import Path

from speedllm.config import compose_config
from speedllm.launcher import launch

assert importlib.util.find_spec("torchao") is None and "torchao" not in sys.modules
root = Path(sys.argv[1])
(root / "text.txt").write_text("hello world\\n" * 20)
ck = root / "pretrain" / "checkpoints"
tiny = ["hardware=cpu", "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2", "train.steps=1",
        "logging.tensorboard=false", "logging.progress_bar=false", "generate.num_samples=0"]
RUNS = [
    ("doctor", ["task=doctor"]),
    ("plan", ["task=plan", "model=qwen3_8b", "hardware=h100", "launcher.nproc_per_node=8", "train.seq_len=4096",
              "train.global_batch_size=64"]),
    ("dryrun", ["task=dryrun", "parallel=tp2", "hardware=cpu"]),
    ("preprocess", ["task=preprocess", f"data.input={root / 'text.txt'}", f"data.output_prefix={root / 'corpus'}"]),
    ("pretrain", ["task=pretrain", *tiny]),
    ("convert", ["task=convert", "convert.to=hf", f"checkpoint.load={ck}", f"convert.out={root / 'hf'}"]),
    ("generate", ["task=generate", "hardware=cpu", f"checkpoint.load={ck}", "generate.prompt=hi",
                  "generate.max_new_tokens=2"]),
    ("chat", ["task=chat", "hardware=cpu", f"checkpoint.load={ck}", "generate.max_new_tokens=2"]),
    ("evaluate", ["task=evaluate", "hardware=cpu", f"checkpoint.load={ck}", "evaluate.steps=1"]),
    ("serve", ["task=serve", f"checkpoint.load={ck}"]),
    ("evaluate.tasks", ["task=evaluate", f"checkpoint.load={ck}", "evaluate.tasks=[hellaswag]"]),
    ("quant", ["task=generate", f"checkpoint.load={ck}", "generate.prompt=hi", "quant=int8_wo"]),
    ("qlora", ["task=sft", "finetune=qlora", *tiny]),
]
for name, overrides in RUNS:
    cfg = compose_config(*overrides, f"run_dir={root / name}")
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr, sys.stdin
    sys.stdout, sys.stderr, sys.stdin = out, err, io.StringIO("hi\\n")
    try:
        status = launch(cfg)
    finally:
        sys.stdout, sys.stderr, sys.stdin = saved
    print(json.dumps({"run": name, "status": status, "err": err.getvalue()}), flush=True)
"""

REFUSED = {
    "serve": "error: task=serve needs fastapi, which is not installed: pip install 'speedllm[serve]'",
    "evaluate.tasks": "error: evaluate.tasks needs lm_eval, which is not installed: pip install 'speedllm[eval]'",
    "quant": "error: quant=int8_wo needs torchao, which is not installed: pip install 'speedllm[quant]'",
    "qlora": "error: finetune=qlora needs torchao, which is not installed: pip install 'speedllm[finetune]'",
}


def test_every_task_runs_or_names_its_extra_without_the_optional_packages(tmp_path):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HIDE % sorted(EXTRAS - base_install()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {r["run"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert len(runs) == 13
    for name, r in runs.items():
        if name in REFUSED:
            assert r["status"] == 2 and r["err"].startswith(REFUSED[name]) and r["err"].count("\n") == 1, r
        else:
            assert r["status"] == 0, r


def test_the_torch_range_is_the_tested_release():
    """setup.cfg allows exactly the torch minor release this suite runs on, and docs/install.md says so."""
    import configparser
    import re

    import torch

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    pin = next(line.strip() for line in setup["options"]["install_requires"].splitlines() if line.startswith("torch"))
    major, minor = map(int, torch.__version__.split(".")[:2])
    assert pin == f"torch>={major}.{minor},<{major}.{minor + 1}"
    assert f"(`{pin}`)" in (ROOT / "docs" / "install.md").read_text()
    assert not re.search(r"any [0-9.]+ ≤ torch", (ROOT / "docs" / "install.md").read_text())
