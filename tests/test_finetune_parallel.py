"""finetune=lora under FSDP2, TP2 and PP2 trains like the single process (CPU/gloo, through the launcher's steps:
test_parallel.run_all, the layouts on one set of 2 ranks); on the hybrid model under TP2 too, with adapters on
every Gated DeltaNet projection, sharded like their base.

Same base (per-shard initialization), same adapter start (seeded per name), 5 steps: losses within 1e-5
(relative) of the single process, adapters after step 5 within 1e-4.
"""

import pytest
from test_parallel import DENSE, HYBRID, losses, run_all

from speedllm.checkpoint.adapters import read_adapters

LORA = ["finetune=lora", "finetune.rank=4", "optim.lr=1e-2"]
# The hybrid model with SGD: AdamW turns the rounding noise of near-zero adapter gradients (in_proj_a's B: ~1e-6)
# into differences past 1e-4; SGD's step is the gradient itself.
SGD = ["optim=sgd", "optim.lr=1.0"]
LAYOUTS = {"fsdp2": (DENSE, ["parallel=fsdp2"]), "tp2": (DENSE, ["parallel=tp2"]), "pp2": (DENSE, ["parallel=pp2"]),
           "hybrid_tp2": (HYBRID, [*SGD, "parallel=tp2"])}
# adapted modules: 4 layers of q, k, v, o, gate, up, down; hybrid: 3 GDN layers of in_proj_qkv, z, b, a, out_proj,
# gate, up, down and one attention layer
ADAPTED = {"single": 4 * 7, "single_hybrid": 3 * 8 + 7}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, launch_here, launch_ranks):
    root = tmp_path_factory.mktemp("lora_parallel")
    jobs = {root / "single": [*DENSE, *LORA, "parallel=single", "train.stop_after=5"],
            root / "single_hybrid": [*HYBRID, *LORA, *SGD, "parallel=single", "train.stop_after=5"]}
    for name, (model, parallel) in LAYOUTS.items():
        jobs[root / name] = [*model, *LORA, *parallel, "train.stop_after=5"]
    run_all(jobs, launch_here, launch_ranks)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_matches_single_process(layout, runs):
    single = "single_hybrid" if LAYOUTS[layout][0] is HYBRID else "single"
    expected, got = losses(runs / single), losses(runs / layout)
    assert len(got) == len(expected) == 5
    for a, b in zip(got, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (got, expected)
    ours = read_adapters(runs / layout / "checkpoints" / "step_00000005")
    theirs = read_adapters(runs / single / "checkpoints" / "step_00000005")
    assert ours.keys() == theirs.keys() and len(ours) == ADAPTED[single] * 2
    for name in theirs:
        assert (ours[name] - theirs[name]).abs().max().item() <= 1e-4, name
    assert any(name.endswith("lora_B.weight") and theirs[name].abs().max() > 0 for name in theirs)  # it trained
