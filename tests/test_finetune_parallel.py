"""finetune=lora under FSDP2, TP2 and PP2 trains like the single process (CPU/gloo, through the launcher's steps:
test_parallel.run_all, the three layouts on one set of 2 ranks).

Same base (per-shard initialization), same adapter start (seeded per name), 5 steps: losses within 1e-5
(relative) of the single process, adapters after step 5 within 1e-4.
"""

import pytest
from test_parallel import DENSE, losses, run_all

from speedllm.checkpoint.adapters import read_adapters

LORA = ["finetune=lora", "finetune.rank=4", "optim.lr=1e-2"]
LAYOUTS = {"fsdp2": ["parallel=fsdp2"], "tp2": ["parallel=tp2"], "pp2": ["parallel=pp2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launch_here, launch_ranks):
    root = tmp_path_factory.mktemp("lora_parallel")
    jobs = {root / "single": [*DENSE, *LORA, "parallel=single", "train.stop_after=5"]}
    for name, parallel in LAYOUTS.items():
        jobs[root / name] = [*DENSE, *LORA, *parallel, "train.stop_after=5"]
    run_all(jobs, launch_here, launch_ranks)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_matches_single_process(layout, runs):
    expected, got = losses(runs / "single"), losses(runs / layout)
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (got, expected)
    ours = read_adapters(runs / layout / "checkpoints" / "step_00000005")
    theirs = read_adapters(runs / "single" / "checkpoints" / "step_00000005")
    assert ours.keys() == theirs.keys() and len(ours) == 4 * 7 * 2
    for name in theirs:
        assert (ours[name] - theirs[name]).abs().max().item() <= 1e-4, name
    assert any(name.endswith("lora_B.weight") and theirs[name].abs().max() > 0 for name in theirs)  # it trained
