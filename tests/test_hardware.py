"""What the CPU computes (speedllm.hardware): the GEMM probe and its cache, hardware.dtype=auto chosen from it,
an explicit hardware.dtype winning under hardware=auto, and a bf16 mixed-precision run on CPU that freezes what ran.

A probe's values are given by writing its cache file (where the machine keeps them), so the choice a CPU with
AVX512-BF16 or AMX makes is checked here too; this machine's own probe is measured once by the cache test.
"""

import json
import os
import subprocess

import pytest
from omegaconf import OmegaConf

from speedllm.config import compose_config
from speedllm.config.resolve import resolve, resolve_hardware
from speedllm.hardware import PROBED, cores, cpu_dtype, cpu_probe, probe_file
from speedllm.native import cache_dir
from speedllm.train.metrics import flops_per_token

pytestmark = pytest.mark.unit

# the [1024x1536].[1536x4096] rates of a 2-core AMD EPYC Zen 5 (AVX512-BF16), and of an AVX2-only one
ZEN5 = {"float32": 163.0, "bfloat16": 847.0}
AVX2 = {"float32": 100.0, "bfloat16": 2.0}
TINY = ["model=qwen3_tiny", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
        "model.head_dim=16", "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
        "train.steps=2", "train.log_every=1", "train.eval_every=0", "logging.progress_bar=false",
        "logging.tensorboard=false", "generate.num_samples=0"]


@pytest.fixture
def probed(tmp_path, monkeypatch):
    """`probed(gflops)`: a cache (XDG_CACHE_HOME) in which this machine's probe measured `gflops`; the compiled
    kernels are this user's (linked, not rebuilt). Returns the environment for a launched process."""

    def make(gflops):
        kernels = cache_dir()
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        (tmp_path / "cache" / "speedllm").mkdir(parents=True, exist_ok=True)
        if kernels.is_dir() and not cache_dir().exists():
            cache_dir().symlink_to(kernels)
        path = probe_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(gflops))
        return dict(os.environ)

    return make


def hardware(*overrides) -> dict:
    cfg = compose_config(*overrides)
    resolve_hardware(cfg)
    return OmegaConf.to_container(cfg.hardware, resolve=True)


def resolved_hardware(tmp_path, *overrides) -> dict:
    cfg = compose_config(f"run_dir={tmp_path}", *overrides)
    resolve(cfg)
    return OmegaConf.to_container(cfg.hardware, resolve=True)


def test_auto_dtype_and_peaks_follow_the_probe(probed):
    assert cpu_dtype(ZEN5) == "bfloat16" and cpu_dtype(AVX2) == "float32"
    assert cpu_dtype({"float32": 100.0, "bfloat16": 110.0}, ("avx512_bf16",)) == "float32"  # the casts eat it
    # too close to call from a timing: the ISA decides, so that a busy box's AMX Xeon (57 / 86 GFLOP/s) picks what
    # a quiet one (333 / 2059) does
    assert cpu_dtype({"float32": 100.0, "bfloat16": 140.0}) == "float32"
    assert cpu_dtype({"float32": 57.0, "bfloat16": 86.0}, ("amx_bf16",)) == "bfloat16" == cpu_dtype(
        {"float32": 333.0, "bfloat16": 2059.0}, ("amx_bf16",))
    probed(ZEN5)
    for overrides in [(), ("hardware=cpu",), ("hardware.dtype=auto",)]:
        hw = hardware(*overrides)
        assert (hw["name"], hw["dtype"]) == ("cpu", "bfloat16"), overrides
        assert hw["peak_tflops"] == {"float32": 0.163, "bfloat16": 0.847}
    assert hardware("hardware.dtype=bfloat16", "hardware.memory_gb=8")["memory_gb"] == 8  # typed values stay
    # an explicit dtype wins through the in-process API too, also when it is the schema's default
    assert hardware("hardware.dtype=float32")["dtype"] == "float32"
    assert hardware("hardware=cuda", "hardware.dtype=auto")["dtype"] == "bfloat16"
    probed(AVX2)
    assert hardware()["dtype"] == "float32" and hardware("hardware=cpu", "hardware.dtype=bfloat16")["dtype"] == "bfloat16"


def test_batch_invariant_mode_is_the_sampling_tasks_default_on_a_bf16_cpu(probed, tmp_path):
    probed(ZEN5)  # auto: bfloat16
    on = [("task=grpo",), ("task=grpo", "hardware=cpu"), ("task=distill", "distill.on_policy=0.5")]
    off = [(), ("task=sft",), ("task=serve",), ("task=distill",), ("task=grpo", "hardware.dtype=float32"),
           ("task=grpo", "hardware.batch_invariant=false"), ("task=grpo", "hardware=cuda")]
    assert [resolved_hardware(tmp_path, *o)["batch_invariant"] for o in on] == [True] * len(on)
    assert [resolved_hardware(tmp_path, *o)["batch_invariant"] for o in off] == [False] * len(off)
    assert resolved_hardware(tmp_path, "hardware.batch_invariant=true")["batch_invariant"] is True  # asked for, on any task
    probed(AVX2)  # auto: float32, where torch's kernels differ by ~1e-6 and the mode costs time
    assert resolved_hardware(tmp_path, "task=grpo")["batch_invariant"] is False


def test_the_probe_measures_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet box (busy: the next test)
    assert not probe_file().exists()
    measured = cpu_probe()
    assert tuple(measured) == PROBED and all(rate > 0 for rate in measured.values())
    assert json.loads(probe_file().read_text()) == measured
    probe_file().write_text(json.dumps(ZEN5))  # read back, not measured again
    assert cpu_probe() == ZEN5


def test_a_busy_box_measurement_is_measured_again_when_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cores(), 0.0, 0.0))  # three runnable tasks per core
    busy = cpu_probe()
    assert json.loads(probe_file().read_text()) == {**busy, "busy": 3.0 * cores()}
    probe_file().write_text(json.dumps({**ZEN5, "busy": 1.0}))
    assert cpu_probe() == ZEN5  # still busy: the cached figures, not a second busy measurement
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    quiet = cpu_probe()  # measured again, and cached for good
    assert quiet != ZEN5 and json.loads(probe_file().read_text()) == quiet


def test_doctor_reports_the_choice_and_an_explicit_dtype_wins(tmp_path, probed, launch_argv):
    env = probed(ZEN5)

    def doctor(*overrides) -> str:
        proc = subprocess.run(launch_argv(tmp_path / "run", "task=doctor", *overrides), capture_output=True,
                              text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return next(line for line in proc.stdout.splitlines() if line.startswith("cpu features:"))

    line = doctor("hardware.dtype=float32")  # under hardware=auto
    assert "float32 163, bfloat16 847" in line and line.endswith("auto picks bfloat16; this run: float32")


def test_bf16_mixed_precision_on_cpu_freezes_what_ran(tmp_path, launch):
    """Typed under hardware=auto (the default), bfloat16 runs: autocast over fp32 master weights, MFU against
    the probe's bfloat16 peak, the frozen config saying so; the losses are float32's to bf16's precision."""
    runs = {}
    for dtype in ("float32", "bfloat16"):
        code, _, err = launch(tmp_path / dtype, *TINY, f"hardware.dtype={dtype}")
        assert code == 0, err
        frozen = OmegaConf.load(tmp_path / dtype / "config.yaml")
        assert (frozen.hardware.name, frozen.hardware.dtype) == ("cpu", dtype)
        assert dict(frozen.hardware.peak_tflops) == pytest.approx({k: v / 1000 for k, v in cpu_probe().items()})
        records = [json.loads(line) for line in (tmp_path / dtype / "metrics.jsonl").read_text().splitlines()]
        flops = flops_per_token(frozen.model, 32)
        for r in records:
            assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / (frozen.hardware.peak_tflops[dtype] * 1e12))
        runs[dtype] = [r["loss"] for r in records]
    assert runs["bfloat16"] != runs["float32"]  # bf16 matmuls ran
    assert runs["bfloat16"] == pytest.approx(runs["float32"], rel=0.01)
