"""Context parallelism on hybrid models (Gated DeltaNet + attention layers) trains like the single process.

Four SFT steps of tiny random transformers-built Qwen3.5 and Qwen3-Next directories (`model=hf`), at seq_len 64,
under cp2 in every parallel.cp_mode, packed and unpacked, and cp4 ring and ulysses packed (Qwen3-Next, MoE: ring
packed; over 4 ranks one rank's FSDP shard holds none of its 5 experts), must give the single process' losses
within 1e-5 (relative).
Packed documents cross the chunk boundaries, so the carried state resets there. One spawned job per cp size runs
all of its layouts in turn, through the training loop the launcher runs.
"""

import shutil
import socket

import pytest
import torch.multiprocessing as mp

from speedllm.parallel.context import CP_MODES
from test_context_parallel import PACKING, _rank, losses, train
from test_hybrid import DEMO_TOKENIZER, hf_model

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# 4 query heads: ulysses over 4 ranks needs heads % cp == 0; 1 kv head is repeated for the all-to-all
HEADS = dict(num_attention_heads=4, num_key_value_heads=1, vocab_size=8192)
KINDS = {"dense": "qwen3_5", "next": "qwen3_next"}
STEPS = ["train.steps=4", "train.seq_len=64"]
CP4_MODES = ("ring", "ulysses")  # the carried state over 4 ranks under both attention layouts; every mode at cp4 on
# the dense model: test_context_parallel


def layouts(cp: int) -> dict:
    out = {f"{kind}_cp{cp}_{mode}_{packing}": [f"parallel.cp={cp}", f"parallel.cp_mode={mode}", *extra]
           for kind in KINDS for mode in CP_MODES for packing, extra in PACKING.items()
           if (kind == "dense" and (cp == 2 or (packing == "packed" and mode in CP4_MODES)))
           or (mode, packing) == ("ring", "packed")}
    if cp == 2:  # activation recompute re-runs the state's broadcasts in backward
        out["dense_cp2_ring_recompute_packed"] = ["parallel.cp=2", "parallel.cp_mode=ring", "train.recompute=full",
                                                  *PACKING["packed"]]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_cp")
    model = {}
    for kind, hf_kind in KINDS.items():
        path = root / f"hf_{kind}"
        hf_model(hf_kind, seed=3, **HEADS).save_pretrained(path)
        for file in DEMO_TOKENIZER.iterdir():
            shutil.copy2(file, path / file.name)
        model[kind] = ["model=hf", f"checkpoint.load_hf={path}", *STEPS]
    for kind in KINDS:
        for packing, extra in PACKING.items():
            train(root / f"{kind}_single_{packing}", [*model[kind], *extra])
    for cp in (2, 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        jobs = [(root / name, [*model[name.split("_")[0]], *overrides]) for name, overrides in layouts(cp).items()]
        mp.spawn(_rank, args=(cp, port, jobs), nprocs=cp)
    return root


@pytest.mark.parametrize("name", [*layouts(2), *layouts(4)])
def test_hybrid_cp_matches_single_process(name, runs):
    kind, packing = name.split("_")[0], name.rsplit("_", 1)[1]
    expected, got = losses(runs / f"{kind}_single_{packing}"), losses(runs / name)
    assert len(got) == len(expected) == 4
    for a, b in zip(got, expected):
        assert abs(a - b) <= 1e-5 * abs(b), (name, got, expected)
