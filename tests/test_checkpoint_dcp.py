"""DCP checkpoints: round trip, keep-K, `latest`, load resolution, and a SIGKILL in the middle of a write."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.checkpoint.dcp import Checkpointer, latest_checkpoint, load_checkpoint, resolve_load, save_checkpoint
from speedllm.errors import UserError

pytestmark = pytest.mark.unit


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.arange(4)).square().sum().backward()
    optimizer.step()
    return model, optimizer


def test_round_trip_keep_and_latest(tmp_path):
    cfg = OmegaConf.create({"train": {"steps": 3}})
    model, optimizer = _model_and_optimizer(0)
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step, model, optimizer, {"step": step, "rank_state": [step]}, cfg, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert latest_checkpoint(str(tmp_path)) == tmp_path / "step_00000003"
    assert OmegaConf.load(tmp_path / "step_00000003" / "config.yaml") == cfg

    fresh_model, fresh_optimizer = _model_and_optimizer(1)
    extra = load_checkpoint(resolve_load("auto", str(tmp_path)), fresh_model, fresh_optimizer)
    assert extra == {"step": 3, "rank_state": [3]}
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()):
        assert torch.equal(a, b)
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert all(torch.equal(saved[i][key], loaded[i][key]) for i in saved)


def test_resolve_load(tmp_path):
    assert resolve_load(None, str(tmp_path)) is None
    assert resolve_load("auto", str(tmp_path)) is None  # nothing saved yet: start fresh
    with pytest.raises(UserError, match="checkpoint.load="):
        resolve_load(str(tmp_path), str(tmp_path))
    model, optimizer = _model_and_optimizer(0)
    save_checkpoint(str(tmp_path), 7, model, optimizer, {"step": 7}, OmegaConf.create({}), keep=0)
    assert resolve_load(str(tmp_path), "elsewhere") == tmp_path / "step_00000007"  # a root: its latest
    assert resolve_load(str(tmp_path / "step_00000007"), "elsewhere") == tmp_path / "step_00000007"


def test_async_save_writes_the_state_of_its_step_while_training_goes_on(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer = Checkpointer(str(tmp_path), keep=3, async_save=True)
    final = checkpointer.save(1, model, optimizer, {"step": 1}, OmegaConf.create({}))
    model(torch.arange(4)).square().sum().backward()  # the next step changes the weights in place
    optimizer.step()
    checkpointer.close()
    assert latest_checkpoint(str(tmp_path)) == final == tmp_path / "step_00000001"
    assert not (tmp_path / ".step_00000001.tmp").exists()
    fresh_model, fresh_optimizer = _model_and_optimizer(1)
    assert load_checkpoint(final, fresh_model, fresh_optimizer) == {"step": 1}
    for name, value in fresh_model.state_dict().items():
        assert torch.equal(value, expected[name]) and not torch.equal(value, model.state_dict()[name])


# Saves step 1, then starts step 2 with DCP's file writer held up right after it wrote the tensor files.
_WRITER = textwrap.dedent("""
    import sys, time
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    from omegaconf import OmegaConf
    from speedllm.checkpoint.dcp import Checkpointer

    root = sys.argv[1]
    checkpointer = Checkpointer(root, keep=3, async_save=sys.argv[2] == "async")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpointer.save(1, model, optimizer, {"step": 1}, OmegaConf.create({}))
    checkpointer.wait()
    torch.save(model.state_dict(), root + "/../expected.pt")
    write_data = fs.FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        result = write_data(self, plan, planner)
        result.wait()
        print("WRITING", flush=True)
        time.sleep(120)
        return result

    fs.FileSystemWriter.write_data = slow_write_data
    with torch.no_grad():
        model.weight.add_(1.0)
    checkpointer.save(2, model, optimizer, {"step": 2}, OmegaConf.create({}))
    checkpointer.wait()  # async: the write goes on in the background meanwhile
""")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_during_write_keeps_previous_checkpoint(tmp_path, mode):
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert any((root / ".step_00000002.tmp").glob("*.distcp"))  # killed with step 2 half written
    assert latest_checkpoint(str(root)) == root / "step_00000001"
    assert not (root / "step_00000002").exists()

    model = torch.nn.Linear(64, 64)
    extra = load_checkpoint(resolve_load("auto", str(root)), model, torch.optim.AdamW(model.parameters()))
    assert extra == {"step": 1}
    expected = torch.load(tmp_path / "expected.pt")
    assert torch.equal(model.weight, expected["weight"]) and torch.equal(model.bias, expected["bias"])

    # the next save of the same step clears the half-written directory
    save_checkpoint(str(root), 2, model, torch.optim.AdamW(model.parameters()), {"step": 2}, OmegaConf.create({}), 3)
    assert latest_checkpoint(str(root)) == root / "step_00000002"
    assert not (root / ".step_00000002.tmp").exists()
