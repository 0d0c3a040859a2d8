"""Expert load in the metrics (docs/moe-metrics.md) against transformers' own router, and the same under ep2 / pp2.

A transformers Qwen3-MoE checkpoint (4 layers, layer 0 dense, 8 experts, top-2) is biased toward expert 0 (and less
toward expert 1): every token embedding gets a shared vector v, and each router's rows 0 and 1 point along v. One
training step through `launch.py` (task=pretrain from that checkpoint, log_every=1) logs the step's
`moe/...` figures; the reference runs transformers' Qwen3MoeForCausalLM on the same global batch with
output_router_logits=True and counts its top-2 assignments with torch.topk. The same run under `parallel=ep2`
(dp2 x ep2, each rank routing its own half of the batch) and `parallel=pp2` (the MoE layers on two stages) logs
the same figures: counts summed over the ranks give the global batch's.
"""

import json
from pathlib import Path

import pytest
import torch

from speedllm.config import compose_config
from speedllm.config.schema import typed

pytestmark = pytest.mark.distributed

MODEL = dict(vocab_size=8192, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             mlp_only_layers=[0])
MOE_LAYERS = [1, 2, 3]
RUN = ["task=pretrain", "model=hf", "hardware=cpu", "hardware.dtype=float32", "train.seq_len=32", "train.micro_batch_size=2",
       "train.global_batch_size=8", "train.log_every=1", "train.eval_every=0", "train.steps=1",
       "checkpoint.save_final=false", "logging.progress_bar=false", "generate.num_samples=0"]
LAYOUTS = {"single": ["parallel=single"], "ep2": ["parallel=ep2"], "pp2": ["parallel=pp2"]}
FIGURES = ("max_load", "dead_experts", "router_entropy")


@pytest.fixture(scope="module")
def biased_hf(tmp_path_factory, save_tiny_hf):
    """(directory, transformers model) of the checkpoint whose routers prefer expert 0, then expert 1."""
    path = tmp_path_factory.mktemp("biased_moe")
    hf = save_tiny_hf(path, seed=3, **MODEL)
    with torch.no_grad():
        v = torch.randn(MODEL["hidden_size"], generator=torch.Generator().manual_seed(4))
        v = v / v.norm()
        hf.model.embed_tokens.weight += 0.1 * v
        for i in MOE_LAYERS:
            hf.model.layers[i].mlp.gate.weight[0] += 0.3 * v
            hf.model.layers[i].mlp.gate.weight[1] += 0.1 * v
    hf.save_pretrained(path)  # over the unbiased weights, beside the tokenizer's files
    return path, hf


def expected_figures(hf, hf_dir: Path, run_dir: Path) -> dict:
    """The step's figures from transformers' router logits on the run's global batch (the loader's first 8 rows)."""
    from speedllm.data.loader import build_loader

    cfg = typed(compose_config(*RUN, f"checkpoint.load_hf={hf_dir}", f"run_dir={run_dir}"))
    t = cfg.train
    loader = build_loader(cfg, "train", 0, 1, t.micro_batch_size, t.seq_len, cfg.seed)
    tokens = torch.cat([next(loader)["tokens"] for _ in range(t.global_batch_size // t.micro_batch_size)])
    with torch.no_grad():
        router_logits = hf(tokens, output_router_logits=True).router_logits
    figures = {}
    for i, logits_NE in zip(MOE_LAYERS, router_logits):  # transformers gives the MoE layers' only
        probs_NE = torch.softmax(logits_NE.float(), dim=-1)
        counts_E = torch.bincount(torch.topk(probs_NE, 2, dim=-1).indices.reshape(-1), minlength=8).float()
        figures[i] = {"max_load": (counts_E.max() / counts_E.mean()).item(),
                      "dead_experts": (counts_E == 0).float().mean().item(),
                      "router_entropy": torch.special.entr(probs_NE).sum(-1).mean().item()}
    return figures


@pytest.fixture(scope="module")
def runs(tmp_path_factory, biased_hf, launch):
    """{layout: the step-1 metrics record} of one training step from the biased checkpoint under each layout."""
    hf_dir, _ = biased_hf
    root = tmp_path_factory.mktemp("runs")
    records = {}
    for name, overrides in LAYOUTS.items():
        code, out, err = launch(root / name, *RUN, f"checkpoint.load_hf={hf_dir}", *overrides, timeout=600)
        assert code == 0, err[-3000:]
        records[name] = json.loads((root / name / "metrics.jsonl").read_text().splitlines()[0])
    return root, records


def test_max_load_follows_transformers_router_assignments(biased_hf, runs):
    hf_dir, hf = biased_hf
    root, records = runs
    expected = expected_figures(hf, hf_dir, root / "reference")
    got = records["single"]
    assert not any(f"moe/layer_0/{name}" in got for name in FIGURES)  # the dense layer has none
    for i in MOE_LAYERS:
        assert expected[i]["max_load"] > 3.0  # the bias shows: expert 0 takes (nearly) every token
        for name in FIGURES:
            assert got[f"moe/layer_{i}/{name}"] == pytest.approx(expected[i][name], rel=1e-5), (i, name)
    assert got["moe/max_load"] == pytest.approx(max(expected[i]["max_load"] for i in MOE_LAYERS), rel=1e-5)
    for name in ("dead_experts", "router_entropy"):
        mean = sum(expected[i][name] for i in MOE_LAYERS) / len(MOE_LAYERS)
        assert got[f"moe/{name}"] == pytest.approx(mean, rel=1e-5)


@pytest.mark.parametrize("layout", ["ep2", "pp2"])
def test_expert_load_under_ep_and_pp_is_the_single_process_figure(layout, runs):
    _, records = runs
    single, got = records["single"], records[layout]
    keys = [k for k in single if k.startswith("moe/")]
    assert len(keys) == 3 + 3 * len(MOE_LAYERS)
    for key in keys:
        assert got[key] == pytest.approx(single[key], rel=1e-5), key
