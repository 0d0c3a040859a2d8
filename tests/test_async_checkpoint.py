"""checkpoint.async_save under FSDP2 on 2 ranks: training is unchanged, and a resume from an async-saved
checkpoint gives the next-step loss of the synchronously saving run, bit for bit. The three runs go one after the
other on one set of 2 ranks, through the launcher's steps (conftest's launch_ranks)."""

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

RUN = ["model=qwen3_tiny", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
       "model.head_dim=16", "hardware=cpu", "parallel=fsdp2", "train.seq_len=32", "train.micro_batch_size=2",
       "train.global_batch_size=4", "train.log_every=1", "train.eval_every=0", "train.steps=3", "checkpoint.every=2",
       "logging.progress_bar=false", "logging.tensorboard=false", "generate.num_samples=0"]


def losses(run_dir: Path) -> list:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "split" not in r]


def test_resume_from_async_checkpoint_matches_sync_run(tmp_path, launch_ranks):
    checkpoints = tmp_path / "async" / "checkpoints"
    launch_ranks(2, {tmp_path / "sync": RUN, tmp_path / "async": [*RUN, "checkpoint.async_save=true"],
                     tmp_path / "resumed": [*RUN, f"checkpoint.load={checkpoints / 'step_00000002'}"]})
    assert "saving in the background" in (tmp_path / "async" / "launch.log").read_text()
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    assert (checkpoints / "latest").read_text().strip() == "step_00000003"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000002", "step_00000003"]
    assert losses(tmp_path / "resumed")[-1] == losses(tmp_path / "sync")[2]
