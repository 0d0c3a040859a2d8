"""Every benchmark runs in its dry form (`python -m benchmarks <name> --dry`: tiny sizes, the same code path), as
a user starts it, so that none can rot; the GPU benchmark's dry table also holds right values."""

import os
import re
import subprocess
import sys

import pytest

from benchmarks import benchmarks
from speedllm.paths import ROOT

pytestmark = pytest.mark.unit

# a line each benchmark prints once its measurements are in (its table's header, or its summary line)
HEADERS = {
    "checkpoint": "stall async / sync (best of each)",
    "cp_memory": "| cp | cp_mode | rank | measured peak MiB |",
    "distill_memory": "distill / (sft + teacher weights) =",
    "fsdp_memory": "| ranks | measured peak MiB |",
    "gemm": "| product | M x K x N | torch GFLOP/s |",
    "gdn": "| dtype | seq | ours s | transformers s | reference s |",
    "gdn_cp": "| cp | max rank peak MiB | / cp1 |",
    "generate": "| metric | transformers | speedllm | ratio | same ids |",
    "gpu": "| decode | qwen3_0.6b, float32, batch 8",
    "grpo": "ours / trl: steps/s",
    "grpo_memory": "| prompts x group | new tokens | measured MiB | planner MiB |",
    "hybrid": "| dtype | params | transformers tokens/s | ours tokens/s | ratio |",
    "init": "peak RSS MiB",
    "model": "ours/transformers: tokens/s",
    "muon": "| optimizer | peak lr | valid loss @ 2 |",
    "peer": "| batch | transformers static cache tokens/s | ours tokens/s | ratio | same ids |",
    "planner": "| model | layout | rank | params held (= predicted) |",
    "preprocess": "| workers | documents | tokens |",
    "qat_vs_ptq": "| model | valid perplexity | vs F | greedy tokens identical to F |",
    "qlora": "step peak qlora / lora",
    "quant": "ours int4_wo",
    "quant_memory": "quant=int8_wo  peak RSS",
    "quant_quality": "greedy tokens identical to fp32",
    "quant_tp": "tp2/tp1",
    "serve": "concurrent answers = one-by-one answers: yes",
    "train": "ratio ours/transformers",
    "varlen": "| path | step CPU s (median) | peak tensor MiB |",
}
# several processes (spawned ranks, launch.py runs, a server) or a minute and more on a 2-core CPU
SLOW = {"cp_memory", "distill_memory", "fsdp_memory", "gpu", "grpo", "hybrid", "init", "muon", "peer", "planner", "qat_vs_ptq",
        "qlora", "quant_memory", "quant_quality", "quant_tp", "serve", "train"}
# optional dependencies (the `test` extras have them all): without one, its benchmarks are skipped
NEEDS = {"grpo": "trl", "qat_vs_ptq": "torchao", "qlora": "torchao", "quant": "torchao", "quant_memory": "torchao",
         "quant_quality": "torchao", "serve": "openai"}


def run(*args, cwd):
    """`python -m benchmarks <args>` as a user runs it from the checkout (here: from `cwd`, the checkout on the
    path, so that a benchmark's files land in the test's directory), on one thread per process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}  # a dry form checks the code path, not speed: no OpenMP threads fighting the other worker
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=1800)


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] * (name in SLOW), id=name)
                                  for name in benchmarks()])
def test_dry_form_runs_and_prints_its_table(name, tmp_path):
    assert name in HEADERS, f"benchmarks/{name}: add its --dry form's header line to HEADERS in this test"
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    proc = run(name, "--dry", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert HEADERS[name] in proc.stdout, proc.stdout[-4000:]
    if name == "gpu":
        check_gpu_table(tmp_path / "gpu_results.md")


def check_gpu_table(path):
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in path.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| section")]
    by_section = {}
    for section, what, ours, titan, hf, notes in rows:
        by_section.setdefault(section, []).append((what, ours, titan, hf, notes))
    assert set(by_section) == {"ops", "train", "compiled", "decode", "offload", "total"}

    # the cuda op set equals the reference on CPU: fp32 to rounding, bf16 to a few bf16 steps
    assert len(by_section["ops"]) == 11
    for what, diff, *_ in by_section["ops"]:
        assert float(diff) <= (1e-4 if "float32" in what else 0.1), what

    # ours and torchtitan (when installed) train the same weights on the same tokens: the same first loss
    loss = lambda cell: float(re.search(r"loss ([0-9.]+)", cell).group(1))  # noqa: E731
    train = by_section["train"]
    assert [what.split(",")[0] for what, *_ in train] == ["qwen3_0.6b", "qwen3_1.7b"]
    for what, ours, titan, *_ in train:
        assert "tok/s" in ours and 5.0 < loss(ours) < 7.5  # ~ln(512) at initialization
        if titan != "-":
            assert abs(loss(titan) - loss(ours)) <= 1e-3 * loss(ours), what
    compiled_bf16, float8 = by_section["compiled"]
    assert abs(loss(compiled_bf16[1]) - loss(train[0][1])) <= 1e-2 * loss(train[0][1])
    assert float8[1] == "skipped"  # no sm89+ GPU here

    # fp32 greedy decoding: our engine gives transformers' static-cache ids
    assert [notes.endswith("same ids: True") for *_, notes in by_section["decode"]] == [True, True]

    # each offload lever trains the same numbers as none (on CPU the host is the device: nothing moves)
    offload = by_section["offload"]
    assert [what.split(", ")[-1] for what, *_ in offload] == ["no offload", "parallel.offload=optimizer",
                                                             "parallel.offload=params", "train.activation_offload=true"]
    losses = [float(re.search(r"loss ([0-9.]+)", notes).group(1)) for *_, notes in offload]
    assert all("s/step" in ours and "GB peak" in ours for _, ours, *_ in offload)
    assert max(losses) - min(losses) <= 1e-5 * losses[0]


def test_list_names_every_benchmark_with_its_summary(tmp_path):
    proc = run("--list", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert list(listed) == list(benchmarks())
    assert "Forward+backward speed and peak memory" in listed["model"]


def test_an_unknown_name_is_refused_in_one_line(tmp_path):
    proc = run("no_such_bench", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--list" in proc.stderr
