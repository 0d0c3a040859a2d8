"""finetune=lora on a tiny transformers Qwen3 (dense and MoE), held against transformers + peft.

Ten SFT steps from HF weights; the adapter exported in PEFT's format and loaded by `PeftModel.from_pretrained`
on transformers' base gives our logits; the merged export loaded by `from_pretrained` gives them too. The first
step's loss is full fine-tuning's, the base stays bit-identical, checkpoints hold only the adapters and resume
bit-exactly, and a PEFT adapter made by peft itself loads into our model with peft's logits.
"""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_hf import save_hf
from test_train_loop import TINY, metrics

from speedllm.adapters.lora import apply_lora, is_adapter
from speedllm.checkpoint.adapters import load_base
from speedllm.checkpoint.dcp import latest_checkpoint, load_checkpoint
from speedllm.checkpoint.hf import load_hf_weights
from speedllm.config import compose_config
from speedllm.data.loader import build_loader
from speedllm.errors import UserError
from speedllm.generation.load import load_model
from speedllm.models.config import ModelConfig
from speedllm.models.qwen3 import Qwen3
from speedllm.paths import CONF
from speedllm.runtime import Runtime, seed_everything
from speedllm.tasks.convert import run as convert
from speedllm.tasks.pretrain import run
from speedllm.train.build import build_model
from speedllm.train.optimizer import build_optimizer
from speedllm.train.schedule import build_scheduler
from speedllm.train.step import train_step

SFT = ["task=sft", "model=hf", "train.seq_len=128", "train.micro_batch_size=2", "train.global_batch_size=2",
       "optim.warmup_steps=0", "optim.schedule=constant", "optim.lr=1e-2"]
LORA = ["finetune=lora", "finetune.rank=4", "finetune.alpha=8"]
NO_AUTOCAST = torch.autocast("cpu", enabled=False)


@pytest.fixture(scope="module", params=["dense_tied", "moe"])
def hf_dir(request, tmp_path_factory):
    """A transformers-saved tiny Qwen3 / Qwen3-MoE over the demo tokenizer's 8192 ids."""
    return save_hf(request.param, tmp_path_factory.mktemp(request.param) / "hf", max_shard_size="1MB",
                   vocab_size=8192)


def config(run_dir, *overrides):
    """test_train_loop's run settings, the model from the overrides (model=hf: from config.json)."""
    run = [o for o in TINY if not o.startswith("model")]
    cfg = compose_config(*run, f"run_dir={run_dir}", f"checkpoint.dir={run_dir}/checkpoints", *overrides)
    OmegaConf.resolve(cfg)
    return cfg


def sft_config(run_dir, hf_dir, *overrides):
    return config(run_dir, *SFT, f"checkpoint.load_hf={hf_dir}", *overrides)


def prepared(cfg):
    """Our model for cfg with its base (and adapters' start) loaded, as the training loop prepares it."""
    pm = build_model(cfg, Runtime())
    if cfg.finetune.name == "full":
        load_hf_weights(pm.parts, cfg.checkpoint.load_hf)
    else:
        load_base(pm.parts, cfg, None)
    return pm


def steps(pm, cfg, n):
    optimizer = build_optimizer(pm.module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, n)
    loader = build_loader(cfg, "train", 0, 1, 2, cfg.train.seq_len, cfg.seed)
    return [train_step(pm, optimizer, scheduler, [next(loader)], cfg, 1, None, NO_AUTOCAST)[0] for _ in range(n)]


def test_first_step_equals_full_finetuning_and_base_stays_bit_identical(hf_dir, tmp_path):
    full = sft_config(tmp_path / "full", hf_dir)
    lora = sft_config(tmp_path / "lora", hf_dir, *LORA)
    (full_loss,) = steps(prepared(full), full, 1)
    pm = prepared(lora)
    model = pm.module
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lora_losses = steps(pm, lora, 4)
    assert lora_losses[0] == full_loss  # B = 0: bitwise the base model's loss
    assert lora_losses[-1] < lora_losses[0]
    after = model.state_dict()
    trained = {k for k in after if not torch.equal(after[k], before[k])}
    assert trained and all(is_adapter(k) for k in trained)
    assert {k for k in after if is_adapter(k) and ".lora_B." in k} <= trained
    assert all(p.requires_grad == is_adapter(n) for n, p in model.named_parameters())


def test_random_base_is_the_one_full_finetuning_starts_from(tmp_path):
    tiny = [o for o in TINY if o.startswith("model")]
    seed_everything(0)
    full = build_model(config(tmp_path, *tiny), Runtime()).module.state_dict()
    seed_everything(0)
    lora = build_model(config(tmp_path, *tiny, *LORA), Runtime()).module.state_dict()
    assert {k for k in lora if not is_adapter(k)} == full.keys()
    assert all(torch.equal(full[k], lora[k]) for k in full)


@pytest.fixture(scope="module")
def trained(hf_dir, tmp_path_factory):
    """A 10-step finetune=lora SFT run through the loop, checkpointed at steps 5 and 10."""
    run_dir = tmp_path_factory.mktemp("lora_run")
    cfg = sft_config(run_dir, hf_dir, *LORA, "train.steps=10", "checkpoint.every=5")
    run(cfg, Runtime())
    return cfg


def our_logits(cfg, ckpt, tokens):
    pm = build_model(cfg, Runtime())
    load_base(pm.parts, cfg, ckpt)
    load_checkpoint(ckpt, pm.module, build_optimizer(pm.module, cfg.optim))
    with torch.no_grad():
        return pm.eval()(tokens)


def test_peft_export_and_merged_export_give_our_logits(trained, hf_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = latest_checkpoint(trained.checkpoint.dir)
    tokens = torch.randint(0, 8192, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = our_logits(trained, ckpt, tokens)

    convert(config(tmp_path / "c1", "task=convert", f"checkpoint.load={trained.checkpoint.dir}", "convert.to=peft",
                   f"convert.out={tmp_path / 'peft'}"), None)
    adapter_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    attention = ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert adapter_config["r"] == 4 and adapter_config["target_modules"] == (
        attention if "moe" in str(hf_dir) else sorted(attention + ["down_proj", "gate_proj", "up_proj"]))
    base = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        base_logits = base(tokens).logits
        theirs = PeftModel.from_pretrained(base, tmp_path / "peft").eval()(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (ours - base_logits).abs().max().item() > 1e-3  # the adapters changed the model

    convert(config(tmp_path / "c2", "task=convert", f"checkpoint.load={trained.checkpoint.dir}", "convert.to=hf",
                   "convert.merge_lora=true", f"convert.out={tmp_path / 'merged'}"), None)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        merged_logits = merged(tokens).logits
    assert (merged_logits - ours).abs().max().item() <= 1e-5
    assert (merged_logits - theirs).abs().max().item() <= 1e-5


def test_checkpoint_holds_only_adapters_and_resumes_bit_exactly(trained, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = latest_checkpoint(trained.checkpoint.dir)
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(is_adapter(k) for k in model_keys)
    # resume from step 5 in a new run dir: steps 6..10 reproduce the straight run's losses exactly
    resumed = OmegaConf.merge(trained, {"run_dir": str(tmp_path), "checkpoint": {
        "dir": str(tmp_path / "checkpoints"), "load": str(ckpt.parent / "step_00000005")}})
    run(resumed, Runtime())
    straight = [r["loss"] for r in metrics(Path(trained.run_dir))]
    assert [r["loss"] for r in metrics(tmp_path)] == straight[5:]


def test_adapter_checkpoint_is_under_5_percent_of_full_at_rank_8_on_qwen3_0_6b():
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                          OmegaConf.load(CONF / "model" / "qwen3_0.6b.yaml"))
    with torch.device("meta"):
        model = Qwen3(cfg)
    full_bytes = sum(p.numel() * 4 for p in model.state_dict().values() if p is not model.lm_head.weight
                     or not cfg.tie_word_embeddings)
    apply_lora(model, 8, 16.0, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    adapter_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    # a training checkpoint holds the trained weights and two AdamW moments of each: the same factor for both
    assert adapter_bytes / full_bytes < 0.05
    print(f"adapter/full checkpoint bytes at rank 8: {adapter_bytes / full_bytes:.4f}")


def test_peft_made_adapter_loads_with_peft_logits_and_mismatches_are_one_line_errors(hf_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    # on MoE, peft maps gate/up/down_proj to the fused expert weights (target_parameters): attention only there
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if "moe" in str(hf_dir) else ["gate_proj", "up_proj",
                                                                                           "down_proj"])
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                 init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    tokens = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = peft_model.eval()(tokens).logits
    cfg = sft_config(tmp_path / "run", hf_dir, *LORA, f"finetune.adapter={tmp_path / 'adapter'}")
    with torch.no_grad():
        ours = prepared(cfg).eval()(tokens)
        generating = load_model(config(tmp_path / "gen", "task=generate", "model=hf", "generate.prompt=x",
                                       f"checkpoint.load_hf={hf_dir}", *LORA, f"finetune.adapter={tmp_path / 'adapter'}"),
                               Runtime())(tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert (generating - theirs).abs().max().item() <= 1e-5  # task=generate|chat|evaluate with the adapter

    for overrides, message in [(["finetune.rank=8"], "adapter r=4 but finetune.rank=8; set finetune.rank=4"),
                               (["finetune.targets=[q_proj,v_proj]"], "set finetune.targets=[")]:
        with pytest.raises(UserError, match=message.replace("[", r"\[")) as err:
            prepared(sft_config(tmp_path / "bad", hf_dir, *LORA, f"finetune.adapter={tmp_path / 'adapter'}",
                                *overrides))
        assert "\n" not in str(err.value)
