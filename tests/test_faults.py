"""Killed ranks stay survivable: under launcher.max_restarts, a worker SIGKILLed at any step is restarted by torch's
elastic agent, the job resumes from its latest checkpoint, and every step's logged loss equals the uninterrupted
run's, bit for bit."""

import os
import re
import signal
import subprocess
import time

import pytest
from test_train_loop import TINY, metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def workers(launcher_pid: int) -> dict:
    """{rank: pid} of the launcher's live worker processes (torch elastic starts them as its children)."""
    found = subprocess.run(["pgrep", "-P", str(launcher_pid), "-f", "speedllm.launcher"], capture_output=True,
                           text=True).stdout.split()
    ranks = {}
    for pid in map(int, found):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except FileNotFoundError:  # ended meanwhile
            continue
        rank = next(int(v.split(b"=")[1]) for v in env if v.startswith(b"RANK="))
        ranks[rank] = pid
    return ranks


def kill_at(proc: subprocess.Popen, run_dir, step: int, rank: int) -> None:
    """SIGKILL `rank` as soon as the job logs `step` (it is then inside step + 1)."""
    deadline = time.time() + 300
    while not ((run_dir / "metrics.jsonl").exists() and any(r["step"] == step for r in metrics(run_dir))):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.02)
    pids = workers(proc.pid)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[rank], signal.SIGKILL)


def test_a_worker_killed_twice_resumes_with_the_uninterrupted_losses(tmp_path, launch, launch_argv):
    """dp2, launcher.max_restarts=3, a checkpoint every 2 steps: rank 1 is killed in step 4, rank 0 (which writes
    the metrics and the checkpoints' metadata) in step 8; each time the agent restarts both ranks, which resume
    from the latest checkpoint (steps 2 and 6, unless the kill came after the next checkpoint). Every record in
    metrics.jsonl, those logged before each kill included, holds the loss the uninterrupted run logged for its
    step. (Step 7 is first logged after the first restart: the job cannot reach it before.)"""
    steps = 10
    common = [*TINY, "parallel=dp2", "checkpoint.every=2", f"train.steps={steps}"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    code, _, err = launch(ref_dir, *common, timeout=600)
    assert code == 0, err
    expected = {r["step"]: r["loss"] for r in metrics(ref_dir)}
    assert sorted(expected) == list(range(1, steps + 1))

    proc = subprocess.Popen(launch_argv(run_dir, *common, "launcher.max_restarts=3"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        kill_at(proc, run_dir, 3, rank=1)
        kill_at(proc, run_dir, 7, rank=0)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", out)]
    assert len(resumed) == 2 and 2 <= resumed[0] <= 4 and 6 <= resumed[1] <= 8, out[-3000:]
    logged = metrics(run_dir)
    assert {r["step"] for r in logged} == set(expected)
    assert [(r["step"], r["loss"]) for r in logged] == [(r["step"], expected[r["step"]]) for r in logged]
