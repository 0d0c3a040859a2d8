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


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_upload_failing_mid_run_stops_it_in_one_line_and_latest_stays(tmp_path, launch, launch_argv, s3):
    """The server stops once the first checkpoint is up: the next save fails (tried 3 times), the run stops with
    one line, and `latest` (what checkpoint.load=auto resumes from) names the last complete checkpoint."""
    from speedllm.checkpoint.dcp import read_metadata, resolve_load

    run = [*TINY, "train.steps=40", "checkpoint.every=1", "checkpoint.keep=0"]
    root = f"{s3.bucket('failing')}/run"
    proc = start(launch_argv, tmp_path / "run", *run, f"checkpoint.dir=s3://{root}")
    try:
        wait_for(proc, lambda: remote_latest(s3, root) is not None, "its first checkpoint")
        s3.stop()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        s3.start()
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and len(errors) == 1, out[-3000:]
    assert re.fullmatch(rf"error: checkpoint.dir: (preparing|writing|publishing) s3://{root}/step_\d+ failed 3 times "
                        r"\(\w+: .*\); `latest` still names the previous checkpoint - .*", errors[0]), errors[0]
    latest = remote_latest(s3, root)
    assert resolve_load("auto", f"s3://{root}") == f"s3://{root}/{latest}"
    assert read_metadata(f"s3://{root}/{latest}").state_dict_metadata  # complete: DCP's metadata, written last
    assert s3.fs().exists(f"{root}/{latest}/extra_rank0.pt")


LAYOUT = [*TINY, "train.global_batch_size=8", "train.micro_batch_size=2", "train.steps=4"]


@pytest.mark.slow
def test_saved_under_fsdp4_resumed_under_fsdp2_and_dp2_in_the_exact_order(tmp_path, launch, s3):
    """4 ranks save at step 2 (to s3://); 2-rank fsdp2 and dp2 jobs resume from it: steps 3-4 consume the global
    samples the uninterrupted fsdp2 run consumed there (its logged consumed_samples: 24, 32), with its losses
    within 1e-5 relative."""
    root = f"s3://{s3.bucket('layouts')}/run"
    code, out, err = launch(tmp_path / "fsdp4", *LAYOUT, "parallel=fsdp4", "train.stop_after=2",
                            f"checkpoint.dir={root}")
    assert code == 0, out + err
    code, out, err = launch(tmp_path / "reference", *LAYOUT, "parallel=fsdp2")
    assert code == 0, out + err
    reference = {r["step"]: r for r in metrics(tmp_path / "reference")}
    assert [reference[s]["consumed_samples"] for s in (1, 2, 3, 4)] == [8, 16, 24, 32]
    for layout in ("fsdp2", "dp2"):
        code, out, err = launch(tmp_path / layout, *LAYOUT, f"parallel={layout}", f"checkpoint.load={root}",
                                f"checkpoint.dir={tmp_path / layout / 'checkpoints'}")
        assert code == 0 and f"resumed from {root}/step_00000002 at step 2" in out, out + err
        resumed = metrics(tmp_path / layout)
        assert [r["step"] for r in resumed] == [3, 4]
        for r in resumed:
            assert r["consumed_samples"] == reference[r["step"]]["consumed_samples"]
            assert r["loss"] == pytest.approx(reference[r["step"]]["loss"], rel=1e-5)


def test_preprocess_from_and_to_s3_gives_the_local_tokens_and_batches(tmp_path, launch, s3):
    """task=preprocess with data.input=s3://...*.jsonl and data.output_prefix=s3://...: the same .bin/.idx bytes
    as from the local files, and a loader on data.path=s3://... yields the local prefix's batches."""
    from conftest import DEMO_TOKENIZER

    from speedllm.config import compose_config
    from speedllm.data.loader import build_loader
    from speedllm.data.preprocess import preprocess

    raw = tmp_path / "raw"
    raw.mkdir()
    for part in range(2):
        lines = [json.dumps({"text": f"Part {part}, line {i}: to be or not to be, {i * i} times."}) for i in range(40)]
        (raw / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")
    fs = s3.fs()
    bucket = s3.bucket("corpus")
    fs.put(str(raw) + "/", f"{bucket}/raw/", recursive=True)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    code, out, err = launch(tmp_path / "run", "task=preprocess", f"data.input=s3://{bucket}/raw/*.jsonl",
                            f"data.output_prefix=s3://{bucket}/tok/c", "logging.progress_bar=false", cache)
    assert code == 0 and "wrote 80 documents" in out, out + err
    preprocess(f"{raw}/*.jsonl", str(tmp_path / "tok" / "c"), str(DEMO_TOKENIZER), workers=1, progress=False)
    for suffix in (".bin", ".idx"):
        assert fs.cat(f"{bucket}/tok/c{suffix}") == (tmp_path / "tok" / f"c{suffix}").read_bytes()

    batches = {}
    for where, path in (("local", tmp_path / "tok" / "c"), ("s3", f"s3://{bucket}/tok/c")):
        cfg = compose_config(f"data.path={path}", cache)
        loader = build_loader(cfg, "train", 0, 1, 2, 16, 0)
        batches[where] = [next(loader)["tokens"] for _ in range(3)]
    assert all((a == b).all() for a, b in zip(batches["local"], batches["s3"]))


def test_hf_model_from_s3_converted_to_a_dcp_checkpoint_on_s3(tmp_path, launch, s3, save_tiny_hf):
    """checkpoint.load_hf=s3://... and convert.out=s3://...: the remote DCP checkpoint holds the HF weights."""
    import torch

    from speedllm.checkpoint.dcp import dcp_load, latest_checkpoint, read_saved_config
    from speedllm.models.hf_adapter import from_hf_state_dict

    hf = save_tiny_hf(tmp_path / "hf", vocab_size=8192)
    bucket = s3.bucket("models")
    s3.fs().put(str(tmp_path / "hf") + "/", f"{bucket}/tiny/", recursive=True)
    code, out, err = launch(tmp_path / "run", "task=convert", "model=hf", f"checkpoint.load_hf=s3://{bucket}/tiny",
                            "convert.to=dcp", f"convert.out=s3://{bucket}/dcp", f"data.cache_dir={tmp_path / 'c'}")
    assert code == 0 and f"convert: wrote s3://{bucket}/dcp/step_00000000" in out, out + err
    ckpt = latest_checkpoint(f"s3://{bucket}/dcp")
    assert ckpt == f"s3://{bucket}/dcp/step_00000000"
    expected = from_hf_state_dict(hf.state_dict(), read_saved_config(ckpt).model)
    state = {"model": {k: torch.empty_like(v) for k, v in expected.items()}}
    dcp_load(state, ckpt)
    assert all(torch.equal(state["model"][k], v) for k, v in expected.items())


def test_bad_storage_is_one_line_before_any_rank_starts(tmp_path, launch_argv, s3):
    """parallel=dp2 with an unknown protocol, a missing bucket, no credentials, and s3fs not importable: exit 2,
    one line naming the key and the fix, and no rank started."""
    fake = tmp_path / "no_s3fs" / "s3fs"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 's3fs'\", name='s3fs')\n")
    no_credentials = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    no_credentials.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent",
                          AWS_EC2_METADATA_DISABLED="true")
    no_s3fs = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")])}
    bucket = s3.bucket("present")
    cases = [
        ("nope://bucket/run", os.environ, "unknown storage protocol 'nope://'; use a local path or an fsspec URL"),
        ("s3://absent-bucket/run", os.environ, "bucket 'absent-bucket' does not exist; create it or choose another"),
        (f"s3://{bucket}/run", no_credentials, "(NoCredentialsError: Unable to locate credentials); give credentials"),
        (f"s3://{bucket}/run", no_s3fs, "needs the 's3://' storage package, which is not installed"),
    ]
    for n, (url, env, message) in enumerate(cases):
        proc = subprocess.run(launch_argv(tmp_path / str(n), *TINY, "parallel=dp2", f"checkpoint.dir={url}"),
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
        assert lines[0].startswith(f"error: checkpoint.dir={url}") and message in lines[0], lines[0]
    assert "pip install 'speedllm[s3]'" in lines[0]
