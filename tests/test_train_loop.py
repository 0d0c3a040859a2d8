"""The pretrain loop end to end on a tiny Qwen3: bit-exact resume, metrics (jsonl, TensorBoard, MFU),
SIGTERM checkpoints, non-finite steps."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from speedllm.checkpoint.dcp import latest_checkpoint, load_checkpoint
from speedllm.config import compose_config
from speedllm.errors import UserError
from speedllm.runtime import Runtime
from speedllm.tasks.pretrain import run
from speedllm.train.build import build_model
from speedllm.train.metrics import flops_per_token
from speedllm.train.optimizer import build_optimizer
from speedllm.train.schedule import build_scheduler
from speedllm.train.step import train_step

pytestmark = pytest.mark.numerics

# A 2-layer, 64-wide Qwen3 on 32-token sequences: 2 micro-batches of 2 per step (gradient accumulation).
TINY = ["model=qwen3_tiny", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
        "model.head_dim=16", "hardware=cpu", "hardware.dtype=float32", "train.seq_len=32", "train.micro_batch_size=2",
        "train.global_batch_size=4", "train.log_every=1", "train.eval_every=0", "optim.warmup_steps=3",
        "optim.lr=3e-3", "logging.progress_bar=false", "generate.num_samples=0"]


def config(run_dir: Path, *overrides):
    cfg = compose_config(*TINY, f"run_dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints", *overrides)
    OmegaConf.resolve(cfg)
    return cfg


def metrics(run_dir: Path, split: str = None) -> list:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == split]


def saved_model(path: Path) -> dict:
    """Model weights of a checkpoint, loaded into a fresh model (by DCP, as a resume would)."""
    cfg = OmegaConf.load(path / "config.yaml")
    model = build_model(cfg, Runtime()).module
    load_checkpoint(path, model, build_optimizer(model, cfg.optim))
    return model.state_dict()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """20 steps in one go, evaluating at steps 10 and 20."""
    run_dir = tmp_path_factory.mktemp("straight")
    run(config(run_dir, "train.steps=20", "train.eval_every=10", "train.eval_steps=2"), Runtime())
    return run_dir


def test_resume_is_bit_exact(straight, tmp_path):
    run(config(tmp_path, "train.steps=20", "train.stop_after=10"), Runtime())
    assert latest_checkpoint(str(tmp_path / "checkpoints")).name == "step_00000010"
    run(config(tmp_path, "train.steps=20", "checkpoint.load=auto"), Runtime())

    expected, resumed = metrics(straight), metrics(tmp_path)
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in expected]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in expected]
    assert expected[-1]["loss"] < expected[0]["loss"] - 0.5  # it learns
    final_a = saved_model(straight / "checkpoints" / "step_00000020")
    final_b = saved_model(tmp_path / "checkpoints" / "step_00000020")
    assert final_a.keys() == final_b.keys()
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def test_metrics_jsonl_tensorboard_and_mfu(straight):
    cfg = OmegaConf.load(straight / "checkpoints" / "step_00000020" / "config.yaml")
    records = metrics(straight)
    assert [r["step"] for r in records] == list(range(1, 21))
    flops = flops_per_token(cfg.model, 32)
    for r in records:
        assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "tflops", "peak_mem_gb"} <= r.keys()
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / (cfg.hardware.peak_tflops.float32 * 1e12))
    assert [r["lr"] for r in records[:3]] == pytest.approx([1e-3, 2e-3, 3e-3])  # warmup over 3 steps
    valid = metrics(straight, "valid")
    assert [r["step"] for r in valid] == [10, 20] and valid[1]["loss"] < valid[0]["loss"]
    assert all(r["ppl"] == pytest.approx(math.exp(r["loss"])) for r in valid)

    events = EventAccumulator(str(straight / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/mfu", "valid/loss",
            "valid/ppl"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 21))
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([r["loss"] for r in records])
    assert [e.step for e in events.Scalars("valid/loss")] == [10, 20]


def test_nonfinite_step_is_skipped(tmp_path):
    cfg = config(tmp_path)
    pm = build_model(cfg, Runtime())
    model = pm.module
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, 10)
    torch.manual_seed(0)
    batch = [{"tokens": torch.randint(0, 8192, (2, 32)), "labels": torch.randint(0, 8192, (2, 32))}]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.norm.weight[0] = math.nan
    loss, grad_norm, ok = train_step(pm, optimizer, scheduler, batch, cfg, 1, None, torch.autocast("cpu", enabled=False))
    assert not ok and math.isnan(loss)
    assert optimizer.state == {} and all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        model.norm.weight[0] = 1.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was updated
    loss, grad_norm, ok = train_step(pm, optimizer, scheduler, batch, cfg, 1, None, torch.autocast("cpu", enabled=False))
    assert ok and math.isfinite(loss) and len(optimizer.state) > 0


def test_diverging_run_stops_without_checkpoint(tmp_path):
    # lr 1e30 makes the first update overflow the weights; every later step is non-finite
    cfg = config(tmp_path, "train.steps=20", "optim.lr=1e30", "optim.warmup_steps=0", "train.max_bad_steps=3",
                 "optim.schedule=constant", "checkpoint.every=1")
    with pytest.raises(UserError, match=r"3 consecutive steps had a non-finite loss .*last at step 4"):
        run(cfg, Runtime())
    assert latest_checkpoint(str(tmp_path / "checkpoints")).name == "step_00000001"  # only the good step
    assert [r["skipped_steps"] for r in metrics(tmp_path)] == [0, 1, 2]


def test_resume_replaces_the_metrics_of_re_run_steps(tmp_path, capsys):
    run(config(tmp_path, "train.steps=8", "checkpoint.every=4", "checkpoint.keep=0"), Runtime())
    first = metrics(tmp_path)
    out = capsys.readouterr().out
    assert f"checkpoint: step 4 saved to {tmp_path / 'checkpoints' / 'step_00000004'}" in out
    assert f"checkpoint.load={tmp_path / 'checkpoints'}" in out.splitlines()[-1]
    run(config(tmp_path, "train.steps=8", f"checkpoint.load={tmp_path / 'checkpoints' / 'step_00000004'}"), Runtime())
    again = metrics(tmp_path)
    assert [r["step"] for r in again] == list(range(1, 9))  # steps 5-8 once, from the second run
    assert [r["loss"] for r in again] == [r["loss"] for r in first]


_TRAINER = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads({threads})  # the test process's count: its runs are compared bit for bit with this one
    sys.path.insert(0, {tests!r})
    from test_train_loop import config
    from speedllm.runtime import Runtime
    from speedllm.tasks.pretrain import run
    from pathlib import Path
    run(config(Path(sys.argv[1]), "train.steps=1000"), Runtime())
""")


def test_sigterm_saves_a_checkpoint_that_resumes(tmp_path):
    sigtermed, straight_dir = tmp_path / "sigterm", tmp_path / "straight"
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER.format(tests=str(Path(__file__).parent), threads=torch.get_num_threads()), str(sigtermed)])
    try:
        deadline = time.time() + 120
        while not ((sigtermed / "metrics.jsonl").exists() and len(metrics(sigtermed)) >= 3):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    stopped = metrics(sigtermed)[-1]["step"]
    assert stopped >= 3 and latest_checkpoint(str(sigtermed / "checkpoints")).name == f"step_{stopped:08d}"

    run(config(sigtermed, "train.steps=1000", "train.stop_after=2", "checkpoint.load=auto"), Runtime())
    run(config(straight_dir, "train.steps=1000", f"train.stop_after={stopped + 2}"), Runtime())
    resumed, expected = metrics(sigtermed), metrics(straight_dir)
    assert [r["step"] for r in resumed] == list(range(1, stopped + 3))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in expected]


@pytest.mark.parametrize("optim,target,lr", [("sgd", "torch.optim.SGD", 0.5),
                                             ("adafactor", "torch.optim.Adafactor", 0.05)])
def test_other_optimizers_train_from_the_command_line_and_resume_only_with_themselves(optim, target, lr, tmp_path,
                                                                                     launch):
    code, _, err = launch(tmp_path, *TINY, f"optim={optim}", f"optim.lr={lr}", "train.steps=8",
                          "optim.warmup_steps=0", "optim.schedule=constant")
    assert code == 0, err
    assert OmegaConf.load(tmp_path / "config.yaml").optim._target_ == target
    losses = [r["loss"] for r in metrics(tmp_path)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2  # it learns
    code, _, err = launch(tmp_path, *TINY, "optim=adamw", "train.steps=10", "checkpoint.load=auto")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"error: checkpoint {tmp_path}/checkpoints/step_00000008 was saved with optimizer {target} but this run uses "
        "torch.optim.AdamW (optim=adamw); resume with the optimizer it was saved with, or start from its weights "
        "with task=convert convert.to=hf and checkpoint.load_hf")


def test_an_optimizer_target_that_does_not_import_is_one_line(tmp_path, launch):
    code, _, err = launch(tmp_path, *TINY, "optim._target_=torch.optim.NoSuchOptimizer")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "error: optim._target_=torch.optim.NoSuchOptimizer cannot be imported (")
