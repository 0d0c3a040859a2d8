"""LoRA on MoE experts (`finetune.targets=[..., experts]`) on qwen3_moe_tiny from a transformers Qwen3-MoE
checkpoint, run through launch.py as a user runs it, held against transformers + peft and the single process.

Ten SFT steps adapting attention and every expert; `task=convert convert.to=peft` writes a directory that
`peft.PeftModel.from_pretrained(Qwen3MoeForCausalLM, dir)` loads (PEFT's target_parameters on the fused
`mlp.experts.gate_up_proj` / `down_proj`) with our logits; the merged export gives them too. The same adapter
trained five steps under ep2 and under fsdp2 is the single process' one; resuming is bit-exact; an adapter made
by peft itself loads into our model with peft's logits.
"""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.adapters.lora import apply_lora
from speedllm.checkpoint.adapters import read_adapters
from speedllm.config import compose_config
from speedllm.models.config import ModelConfig
from speedllm.models.qwen3 import Qwen3
from speedllm.paths import CONF
from speedllm.runtime import Runtime

pytestmark = [pytest.mark.numerics, pytest.mark.slow]

TARGETS = "finetune.targets=[q_proj,v_proj,experts]"
RUN = ["task=sft", "model=hf", "finetune=lora", "finetune.rank=4", "finetune.alpha=8", "train.seq_len=32",
       "train.micro_batch_size=1", "train.global_batch_size=2", "optim.warmup_steps=0", "optim.schedule=constant",
       "hardware=cpu", "hardware.dtype=float32", "logging.progress_bar=false", "generate.num_samples=0", "train.eval_every=0",
       "train.log_every=1", "checkpoint.every=5"]
# the parallel runs: SGD, whose update is linear in the gradient, so the layouts' fp32 summation orders stay
# ~1e-7 apart (AdamW turns that noise in near-zero gradient entries into whole lr-sized steps of single entries)
SGD = ["optim=sgd", "optim.lr=0.05", "train.steps=5"]


@pytest.fixture(scope="module")
def hf_dir(save_tiny_hf, tmp_path_factory):
    """transformers' save_pretrained of a random Qwen3-MoE shaped as conf/model/qwen3_moe_tiny.yaml."""
    shape = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "qwen3_moe_tiny.yaml"))
    shape.pop("tokenizer")
    path = tmp_path_factory.mktemp("moe") / "hf"
    save_tiny_hf(path, seed=3, **shape)
    return path


def train(launch, run_dir: Path, hf_dir, *overrides):
    code, out, err = launch(run_dir, f"run_dir={run_dir}", *RUN, f"checkpoint.load_hf={hf_dir}", TARGETS, *overrides,
                            timeout=900)
    assert code == 0, err[-3000:]
    return run_dir / "checkpoints"


def losses(run_dir: Path):
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def trained(launch, hf_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single10")
    return train(launch, run_dir, hf_dir, "train.steps=10", "optim.lr=1e-2"), run_dir


def test_experts_alone_adapt_every_expert_projection_and_nothing_else():
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / "qwen3_moe_tiny.yaml"))
    with torch.device("meta"):
        model = Qwen3(cfg)
    apply_lora(model, 4, 8.0, 0.0, ["experts"])
    trained = {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert trained == {f"layers.{n}.mlp.experts.adapter.{name}": shape for n in range(cfg.num_hidden_layers)
                       for name, shape in [("lora_A.gate_up", (e, 4, d)), ("lora_B.gate_up", (e, 2 * i, 4)),
                                           ("lora_A.down", (e, 4, i)), ("lora_B.down", (e, d, 4))]}


def test_peft_export_and_merged_export_give_our_logits(launch, trained, hf_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from speedllm.config.resolve import adopt_checkpoint_config
    from speedllm.generation.load import load_model

    ckpt, _ = trained
    for name, extra in (("peft", ["convert.to=peft"]), ("merged", ["convert.to=hf", "convert.merge_lora=true"])):
        code, _, err = launch(tmp_path / f"c_{name}", "task=convert", f"checkpoint.load={ckpt}", *extra,
                              f"convert.out={tmp_path / name}")
        assert code == 0, err[-3000:]
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (config["target_modules"], config["target_parameters"]) == (
        ["q_proj", "v_proj"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    adapters = read_adapters(sorted(ckpt.glob("step_*"))[-1])
    assert all(adapters[k].abs().max() > 0 for k in adapters if ".experts.adapter.lora_B." in k)  # experts trained

    tokens = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(0))
    cfg = compose_config("task=generate", "hardware=cpu", "hardware.dtype=float32", f"checkpoint.load={ckpt}", "generate.prompt=x",
                         f"run_dir={tmp_path / 'gen'}")
    OmegaConf.resolve(cfg)
    adopt_checkpoint_config(cfg)
    base = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        ours = load_model(cfg, Runtime())(tokens)
        base_logits = base(tokens).logits
        theirs = PeftModel.from_pretrained(base, tmp_path / "peft").eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - base_logits).abs().max().item() > 1e-2  # the adapters changed the model
    assert (merged - ours).abs().max().item() <= 1e-5
    assert (merged - theirs).abs().max().item() <= 1e-5


def test_resume_from_step_5_is_bit_exact(launch, trained, hf_dir, tmp_path):
    ckpt, run_dir = trained
    train(launch, tmp_path, hf_dir, "train.steps=10", "optim.lr=1e-2", f"checkpoint.load={ckpt / 'step_00000005'}")
    assert losses(tmp_path) == losses(run_dir)[5:]


@pytest.mark.distributed
def test_ep2_and_fsdp2_train_the_single_process_adapter(launch, hf_dir, tmp_path):
    runs = {layout: read_adapters(train(launch, tmp_path / layout, hf_dir, *SGD, f"parallel={layout}")
                                  / "step_00000005") for layout in ("single", "ep2", "fsdp2")}
    single = runs.pop("single")
    assert any(".experts.adapter." in name for name in single)
    for layout, adapters in runs.items():
        assert adapters.keys() == single.keys()
        for name, tensor in single.items():
            relative = ((adapters[name] - tensor).abs().max() / tensor.abs().max()).item()
            assert relative <= 1e-5, (layout, name, relative)


def test_peft_made_expert_adapter_loads_with_peft_logits_and_a_partial_one_is_refused(hf_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from speedllm.errors import UserError
    from speedllm.checkpoint.adapters import load_base
    from speedllm.train.build import build_model

    def saved(name, parameters):
        base = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                target_parameters=parameters, init_lora_weights=False))
        model.save_pretrained(tmp_path / name)
        return model.eval()

    def ours(adapter):
        cfg = compose_config(*RUN, f"checkpoint.load_hf={hf_dir}", "finetune.targets=[q_proj,experts]",
                             f"finetune.adapter={adapter}", f"run_dir={tmp_path / 'run'}")
        OmegaConf.resolve(cfg)
        pm = build_model(cfg, Runtime())
        load_base(pm.parts, cfg, None)
        return pm.eval()

    tokens = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(1))
    peft_model = saved("full", ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    with torch.no_grad():
        theirs, logits = peft_model(tokens).logits, ours(tmp_path / "full")(tokens)
    assert (logits - theirs).abs().max().item() <= 1e-5

    saved("partial", ["mlp.experts.down_proj"])
    with pytest.raises(UserError, match="adapts mlp.experts.gate_up_proj and mlp.experts.down_proj together") as err:
        ours(tmp_path / "partial")
    assert "\n" not in str(err.value)


def test_expert_targets_on_a_dense_model_and_dropout_are_refused_before_launch(launch, tmp_path):
    for n, (overrides, message) in enumerate([
            (["model=qwen3_tiny", "finetune.targets=[experts]"], "has no experts"),
            (["model=qwen3_moe_tiny", "finetune.targets=[experts]", "finetune.dropout=0.1"],
             "LoRA on the experts has no dropout")]):
        code, _, err = launch(tmp_path / str(n), "task=sft", "finetune=lora", "hardware=cpu", "hardware.dtype=float32", *overrides)
        assert code == 2 and message in err, err[-2000:]
