"""Checkpoints, data and models by URL (speedllm.storage) against a real S3 server on localhost (the `s3` fixture):
a run on s3:// killed and resumed logs the local run's losses bit for bit, a failed upload leaves `latest` on the
previous checkpoint, and bad URLs are one line each before any rank starts."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from test_train_loop import TINY, metrics

pytestmark = pytest.mark.distributed


def remote_latest(s3, root: str):
    fs = s3.fs()
    return fs.cat(f"{root}/latest").decode().strip() if fs.exists(f"{root}/latest") else None


def start(launch_argv, run_dir, *overrides) -> subprocess.Popen:
    return subprocess.Popen(launch_argv(run_dir, *overrides), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for(proc: subprocess.Popen, ready, what: str) -> None:
    deadline = time.time() + 120
    while not ready():
        assert proc.poll() is None and time.time() < deadline, f"ended before {what}: {proc.communicate()[0][-3000:]}"
        time.sleep(0.02)


def test_s3_run_killed_and_resumed_logs_the_local_losses_bit_for_bit(tmp_path, launch, launch_argv, s3):
    """checkpoint.dir=s3://...: SIGKILLed once its first checkpoint is up, resumed with checkpoint.load=auto (with
    async saves); every step's loss equals the uninterrupted local run's, keep=2 pruned the remote steps, and the
    run's metrics.jsonl and config.yaml are beside the checkpoints."""
    run = [*TINY, "train.steps=8", "checkpoint.every=2", "checkpoint.keep=2"]
    code, _, err = launch(tmp_path / "local", *run)
    assert code == 0, err
    expected = [(r["step"], r["loss"]) for r in metrics(tmp_path / "local")]
    root = f"{s3.bucket('runs')}/run"
    proc = start(launch_argv, tmp_path / "s3", *run, f"checkpoint.dir=s3://{root}")
    try:
        wait_for(proc, lambda: remote_latest(s3, root) is not None, "its first checkpoint")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    killed_at = int(remote_latest(s3, root).split("_")[1])
    assert proc.returncode == -signal.SIGKILL and killed_at < 8

    code, out, err = launch(tmp_path / "s3", *run, f"checkpoint.dir=s3://{root}", "checkpoint.load=auto",
                            "checkpoint.async_save=true")
    assert code == 0, out + err
    assert re.search(rf"resumed from s3://{root}/step_(\d+) at step (\d+)", out).groups() == (f"{killed_at:08d}",
                                                                                              str(killed_at))
    assert [(r["step"], r["loss"]) for r in metrics(tmp_path / "s3")] == expected
    fs = s3.fs()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(root)) == ["config.yaml", "latest", "metrics.jsonl",
                                                                "step_00000006", "step_00000008"]
    assert remote_latest(s3, root) == "step_00000008"
    assert fs.cat(f"{root}/metrics.jsonl").decode() == (tmp_path / "s3" / "metrics.jsonl").read_text()
    assert fs.cat(f"{root}/config.yaml").decode() == (tmp_path / "s3" / "config.yaml").read_text()
