"""benchmarks/gpu.py runs end to end on CPU (--dry: tiny models, same code path), so the GPU benchmark cannot rot
between the days a GPU is lent."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_benchmark_dry_run_writes_a_table_of_right_values(tmp_path):
    out = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry", "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.read_text().splitlines()
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
