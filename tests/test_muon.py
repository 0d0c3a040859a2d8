"""optim=muon: the update against torch.optim.Muon + torch.optim.AdamW, which parameters each one gets, FSDP2
against the single process, bit-exact resume, and the config's one-line errors."""

import copy
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.checkpoint.dcp import latest_checkpoint
from speedllm.config import compose_config
from speedllm.config.validate import check_choices, check_values
from speedllm.errors import UserError
from speedllm.models.qwen3 import Qwen3
from speedllm.runtime import Runtime
from speedllm.tasks.pretrain import run
from speedllm.train.optimizer import build_optimizer

pytestmark = pytest.mark.numerics

HIDDEN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
          "down_proj.weight", "experts.gate_proj", "experts.up_proj", "experts.down_proj")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
# 2-layer, 64-wide Qwen3 on 32-token sequences, 2 micro-batches of 2 per step; a constant lr after 2 warmup steps
TINY = ["model=qwen3_tiny", "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=2",
        "model.head_dim=16", "hardware=cpu", "hardware.dtype=float32", "train.seq_len=32", "train.micro_batch_size=2", "train.log_every=1", "train.eval_every=0", "optim=muon",
        "optim.warmup_steps=2", "optim.schedule=constant", "logging.progress_bar=false",
        "logging.tensorboard=false", "generate.num_samples=0"]


def muon_cfg(*overrides):
    return compose_config("optim=muon", "run_dir=.", *overrides).optim


def tiny_model(tiny_model_cfg, seed=0, **overrides) -> Qwen3:
    torch.manual_seed(seed)
    model = Qwen3(tiny_model_cfg(**overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model


def names_by_group(model, optimizer) -> list:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [(g["muon"], g["weight_decay"], sorted(name_of[id(p)] for p in g["params"])) for g in optimizer.param_groups]


@pytest.mark.unit
@pytest.mark.parametrize("moe,tied", [(False, True), (True, False)])
def test_param_split_muon_for_hidden_matrices_adamw_for_the_rest(tiny_model_cfg, moe, tied):
    model = tiny_model(tiny_model_cfg, tie_word_embeddings=tied, **(MOE if moe else {}))
    optim = muon_cfg()
    names = [n for n, _ in model.named_parameters()]
    hidden = sorted(n for n in names if n.endswith(HIDDEN))
    one_d = sorted(n for n, p in model.named_parameters() if p.ndim == 1)  # norms (the model has no biases)
    routers = [n for n in names if n.endswith("mlp.gate.weight")]
    decayed = sorted(routers + ([] if tied else ["lm_head.weight"]))  # a tied output is the embedding
    no_decay = sorted(one_d + ["embed_tokens.weight"])
    assert any("experts" in n for n in hidden) == moe and bool(routers) == moe and ("lm_head.weight" in names) != tied
    expected = [(True, optim.weight_decay, hidden), (False, optim.adamw_weight_decay, decayed),
                (False, 0.0, no_decay)]
    assert names_by_group(model, build_optimizer(model, optim)) == [g for g in expected if g[2]]


@pytest.mark.unit
@pytest.mark.parametrize("moe", [False, True])
def test_update_equals_torch_muon_and_adamw(tiny_model_cfg, moe):
    """Three steps on random gradients: bit for bit torch.optim.Muon on the hidden matrices (each expert's matrix a
    parameter of its own) and torch.optim.AdamW on the rest, with the config's settings."""
    optim = muon_cfg("optim.ns_dtype=bfloat16", "optim.weight_decay=0.05", "optim.adamw_weight_decay=0.02")
    ours_model = tiny_model(tiny_model_cfg, tie_word_embeddings=not moe, **(MOE if moe else {}))
    ref_model, start = copy.deepcopy(ours_model), copy.deepcopy(ours_model)
    ours = build_optimizer(ours_model, optim)

    named = dict(ref_model.named_parameters())
    hidden = [n for n in named if n.endswith(HIDDEN)]
    # torch's Muon takes 2-D parameters only: every expert's [out, in] slice becomes its own leaf
    ref_leaves = {n: [torch.nn.Parameter(m.clone()) for m in named[n]] if named[n].ndim == 3
                  else [named[n]] for n in hidden}
    muon = torch.optim.Muon([p for leaves in ref_leaves.values() for p in leaves], lr=optim.lr,
                            weight_decay=optim.weight_decay, momentum=optim.momentum, nesterov=optim.nesterov,
                            ns_coefficients=tuple(optim.ns_coefficients), eps=optim.eps, ns_steps=optim.ns_steps)
    decayed = [p for n, p in named.items() if n not in hidden and p.ndim == 2 and n != "embed_tokens.weight"]
    rest = [p for n, p in named.items() if n not in hidden and not any(p is q for q in decayed)]
    adamw = torch.optim.AdamW([{"params": decayed, "weight_decay": optim.adamw_weight_decay},
                               {"params": rest, "weight_decay": 0.0}], lr=optim.adamw_lr,
                              betas=tuple(optim.adamw_betas), eps=optim.adamw_eps, fused=True)

    for step in range(3):
        torch.manual_seed(100 + step)
        for name, p in ours_model.named_parameters():
            p.grad = torch.randn_like(p)
            if name in ref_leaves and named[name].ndim == 3:
                for leaf, g in zip(ref_leaves[name], p.grad):
                    leaf.grad = g.clone()
            else:
                named[name].grad = p.grad.clone()
        ours.step()
        muon.step()
        adamw.step()
    for name, p in ours_model.named_parameters():
        expected = torch.stack(ref_leaves[name]) if named[name].ndim == 3 else named[name]
        assert torch.equal(p, expected), name
    assert not torch.equal(ours_model.layers["0"].self_attn.q_proj.weight, start.layers["0"].self_attn.q_proj.weight)


@pytest.mark.unit
def test_float32_newton_schulz_stays_near_torchs_bfloat16(tiny_model_cfg):
    """ns_dtype=float32 (the CPU default) is the same iteration: one step lands within bfloat16's rounding, which
    compounds over the 5 iterations to ~2% of the update (measured 1.8%)."""
    models = [tiny_model(tiny_model_cfg) for _ in range(2)]
    for model, dtype in zip(models, ("float32", "bfloat16")):
        torch.manual_seed(7)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        build_optimizer(model, muon_cfg(f"optim.ns_dtype={dtype}")).step()
    a, b = (m.layers["0"].mlp.up_proj.weight for m in models)
    start = tiny_model(tiny_model_cfg).layers["0"].mlp.up_proj.weight
    assert (a - b).abs().max() <= 0.04 * (b - start).abs().max()


def metrics(run_dir: Path) -> list:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "split" not in r]


def test_resume_is_bit_exact_and_refuses_another_optimizer(tmp_path, launch):
    def config(run_dir, *overrides):
        cfg = compose_config(*TINY, "train.global_batch_size=4", f"run_dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints", *overrides)
        OmegaConf.resolve(cfg)
        return cfg

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(config(straight, "train.steps=8"), Runtime())
    run(config(resumed, "train.steps=8", "train.stop_after=4"), Runtime())
    assert latest_checkpoint(str(resumed / "checkpoints")).name == "step_00000004"
    run(config(resumed, "train.steps=8", "checkpoint.load=auto"), Runtime())
    expected = metrics(straight)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in metrics(resumed)] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in expected]
    assert expected[-1]["loss"] < expected[0]["loss"] - 0.2  # it learns (8.68 from 9.02)

    code, _, err = launch(resumed, *TINY, "train.global_batch_size=4", "optim=adamw", "train.steps=10",
                          "checkpoint.load=auto")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"error: checkpoint {resumed}/checkpoints/step_00000008 was saved with optimizer speedllm.train.muon.MuonAdamW "
        "but this run uses torch.optim.AdamW (optim=adamw); resume with the optimizer it was saved with, or start from "
        "its weights with task=convert convert.to=hf and checkpoint.load_hf")


@pytest.mark.distributed
def test_fsdp2_and_tp2_follow_the_single_process(tmp_path, launch_here, launch_ranks):
    """`optim=muon parallel=fsdp2` and `parallel=tp2` (2 gloo ranks each, every matrix's update gathered for
    Newton-Schulz) follow the single-process run within 1e-4 relative over 5 steps (the launcher's steps: the single
    run in this process, the two layouts in turn on one set of 2 ranks)."""
    common = [*TINY, "train.global_batch_size=8", "train.steps=5"]
    launch_here(tmp_path / "single", *common, "parallel=single")
    launch_ranks(2, {tmp_path / name: [*common, f"parallel={name}"] for name in ("fsdp2", "tp2")})
    single = [r["loss"] for r in metrics(tmp_path / "single")]
    assert len(single) == 5 and single[-1] < single[0]
    for name in ("fsdp2", "tp2"):
        got = [r["loss"] for r in metrics(tmp_path / name)]
        assert len(got) == 5 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(got, single)), (name, got, single)


@pytest.mark.unit
@pytest.mark.parametrize("override,message", [
    ("optim.adamw_lr=0", "optim.adamw_lr=0.0 must be > 0; set optim.adamw_lr to such a value"),
    ("optim.lr=-1", "optim.lr=-1.0 must be > 0; set optim.lr to such a value"),
    ("optim.momentum=1.0", "optim.momentum=1.0 must be in [0, 1); set optim.momentum to such a value"),
    ("optim.ns_steps=0", "optim.ns_steps=0 must be in [1, 99]; set optim.ns_steps to such a value"),
    ("optim.ns_coefficients=[1,2]", "optim.ns_coefficients=[1.0, 2.0] must be three values a,b,c like "
     "[3.4445,-4.775,2.0315]; set optim.ns_coefficients to such a value"),
    ("optim.adamw_betas=[0.9,1.0]", "optim.adamw_betas=[0.9, 1.0] must be two values in [0, 1), like [0.9,0.95]; "
     "set optim.adamw_betas to such a value"),
    ("optim.ns_dtype=float16", "optim.ns_dtype=float16 is not one of bfloat16, float32; pick one of them"),
    ("optim.adjust_lr_fn=rms", "optim.adjust_lr_fn=rms is not one of original, match_rms_adamw; pick one of them"),
])
def test_bad_values_are_one_line(override, message):
    cfg = compose_config("optim=muon", "run_dir=.", override)
    with pytest.raises(UserError) as e:
        check_choices(cfg)
        check_values(cfg)
    assert str(e.value) == message


def test_a_bad_value_stops_the_launch_in_one_line(tmp_path, launch):
    code, _, err = launch(tmp_path, *TINY, "optim.adamw_lr=0")  # before any worker starts
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "error: optim.adamw_lr=0.0 must be > 0; set optim.adamw_lr to such a value"
