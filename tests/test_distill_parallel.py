"""task=distill under FSDP2 and TP2 (CPU/gloo, through the launcher): the student sharded, the teacher sharded
likewise (FSDP2 gathering its output weight for the loss; TP's vocabulary rows, the divergence reduced over the
tensor axis) or whole on each rank (FSDP2 with distill.teacher_parallel=replicate), 3 steps equal the single
process within 1e-5 relative: loss and every distill/ metric."""

import json

import pytest
from test_hf import save_hf
from test_parallel import DENSE, run_all

pytestmark = pytest.mark.distributed

# jsd with a CE share, a top-k teacher and chunks of 16 positions: every reduction of the vocabulary-parallel loss
DISTILL = ["task=distill", "distill.loss=jsd", "distill.beta=0.3", "distill.temperature=2.0", "distill.top_k=50",
           "distill.ce_weight=0.1", "train.loss_chunk_size=16", "train.stop_after=3", "optim.lr=1e-2"]
LAYOUTS = {"fsdp2": ["parallel=fsdp2"], "tp2": ["parallel=tp2"],
           "fsdp2_whole_teacher": ["parallel=fsdp2", "distill.teacher_parallel=replicate"]}


def records(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fsdp2_and_tp2_equal_the_single_process(tmp_path, launch_here, launch_ranks):
    teacher = save_hf("dense_tied", tmp_path / "teacher", max_shard_size="1MB", vocab_size=8192)
    run = [*DENSE, *DISTILL, f"distill.teacher={teacher}"]
    layouts = {"single": ["parallel=single"], **LAYOUTS}
    run_all({tmp_path / name: [*run, *layout] for name, layout in layouts.items()}, launch_here, launch_ranks)
    expected = records(tmp_path / "single")
    assert len(expected) == 3 and expected[-1]["distill/loss"] < expected[0]["distill/loss"]
    for layout in LAYOUTS:
        got = records(tmp_path / layout)
        for ours, theirs in zip(got, expected, strict=True):
            for key in ("loss", "distill/loss", "distill/kl", "distill/ce", "distill/top1_agree"):
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (layout, key, got, expected)


@pytest.mark.slow
def test_on_policy_samples_do_not_depend_on_the_layout(tmp_path, launch_here, launch_ranks):
    """distill.on_policy=1: each row's completions are drawn from its index in the data, so two data-parallel
    ranks sample what one process samples and the steps agree within 1e-5."""
    teacher = save_hf("dense_tied", tmp_path / "teacher", max_shard_size="1MB", vocab_size=8192)
    run = [*DENSE, *DISTILL, f"distill.teacher={teacher}", "distill.on_policy=1.0", "distill.top_k=null"]
    layouts = {"single": ["parallel=single"], "dp2": ["parallel=dp2"]}
    run_all({tmp_path / name: [*run, *layout] for name, layout in layouts.items()}, launch_here, launch_ranks)
    expected, got = records(tmp_path / "single"), records(tmp_path / "dp2")
    assert all(r["on_policy"] == 1.0 for r in expected)
    for ours, theirs in zip(got, expected, strict=True):
        for key in ("loss", "distill/loss", "distill/kl", "distill/ce", "distill/top1_agree"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5), (key, got, expected)
