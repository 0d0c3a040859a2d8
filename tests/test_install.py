"""A non-editable `pip install .` into a fresh venv gives a `speedllm` command that trains from any directory."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from speedllm.paths import ROOT

pytestmark = [pytest.mark.unit, pytest.mark.slow]

TINY = ["hardware=cpu", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
        "model.head_dim=16", "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2",
        "train.log_every=1", "train.eval_every=0", "logging.progress_bar=false", "logging.tensorboard=false",
        "checkpoint.save_final=false", "generate.num_samples=0"]


def test_pip_install_then_speedllm_trains_outside_the_repository(tmp_path):
    venv, source, elsewhere = tmp_path / "venv", tmp_path / "source", tmp_path / "elsewhere"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    # The dependencies come from this interpreter's site-packages, named as a plain path: the .pth files there
    # (an editable install's hooks) do not run, so the venv sees only the speedllm it installs.
    Path(venv_site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # What `pip install .` reads from a checkout, copied so that the build leaves nothing in the repository.
    shutil.copytree(ROOT / "speedllm", source / "speedllm", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", str(source)], check=True, capture_output=True, timeout=300)
    shutil.rmtree(source)  # the installed package must not lean on the copy it was built from

    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import speedllm; print(speedllm.__file__)"], check=True,
                           capture_output=True, text=True, cwd=elsewhere, env=env).stdout.strip()
    assert where.startswith(str(venv)), where

    run_dir = tmp_path / "run"
    proc = subprocess.run([str(venv / "bin" / "speedllm"), "train.steps=3", f"hydra.run.dir={run_dir}", *TINY],
                          capture_output=True, text=True, timeout=300, cwd=elsewhere, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r and "split" not in r] == [1, 2, 3]
    assert (run_dir / "config.yaml").is_file()
    assert not any(elsewhere.iterdir()), "the run writes only under hydra.run.dir"
