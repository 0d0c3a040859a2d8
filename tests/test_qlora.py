"""finetune=qlora: the adapted projections' frozen weights are torchao NF4 tensors, training changes only the
adapters and follows LoRA's losses closely, and the planner's bytes per base weight are those torchao stores."""

import pytest
import torch
from omegaconf import OmegaConf
from test_finetune_lora import LORA, config, steps
from test_train_loop import TINY

from speedllm.adapters.lora import target_linears
from speedllm.checkpoint.adapters import base_bytes, load_base
from speedllm.models.config import ModelConfig
from speedllm.models.qwen3 import Qwen3
from speedllm.paths import CONF
from speedllm.runtime import Runtime, seed_everything
from speedllm.train.build import build_model

SFT = ["task=sft", "train.seq_len=64", "optim.warmup_steps=0", "optim.lr=1e-2"]
# every projection a multiple of NF4's 64 x 256 blocks
NF4_SIZES = ["model.hidden_size=128", "model.head_dim=64", "model.intermediate_size=128"]


def test_qlora_base_is_nf4_and_trains_like_lora(tmp_path):
    from torchao.quantization import to_nf4

    losses, full = {}, {}
    for mode in ("lora", "qlora"):
        cfg = config(tmp_path / mode, *TINY, *NF4_SIZES, *SFT, *LORA, f"finetune={mode}")
        seed_everything(cfg.seed)
        pm = build_model(cfg, Runtime())
        load_base(pm.parts, cfg, None)
        adapted = target_linears(pm.module, cfg.finetune.targets)
        if mode == "lora":
            full = {name: linear.weight.detach().clone() for name, linear in adapted.items()}
        else:
            for name, linear in adapted.items():
                assert type(linear.weight).__name__ == "NF4Tensor" and not linear.weight.requires_grad
                # the same NF4 as torchao's own quantization of the fp32 weight LoRA's run starts from
                assert torch.equal(linear.weight.get_original_weight(), to_nf4(full[name]).get_original_weight())
        losses[mode] = steps(pm, cfg, 3)
    assert losses["qlora"][-1] < losses["qlora"][0] and len(losses["qlora"]) == len(losses["lora"]) == 3
    for a, b in zip(losses["qlora"], losses["lora"]):
        assert a == pytest.approx(b, rel=0.02)


def test_planner_bytes_per_base_weight_match_torchao_nf4():
    from torchao.quantization import to_nf4

    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / "qwen3_tiny.yaml"),
                          OmegaConf.from_dotlist(NF4_SIZES).model)
    ft = OmegaConf.create({"name": "qlora", "rank": 8, "alpha": 16.0, "dropout": 0.0,
                           "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})
    facts = base_bytes(cfg, ft)
    model = Qwen3(cfg)
    stored = 0
    adapted = target_linears(model, ft.targets)
    for linear in adapted.values():
        nf4 = to_nf4(linear.weight.detach())
        stored += sum(t.numel() * t.element_size() for t in (nf4.quantized_data, nf4.quantized_scalers,
                                                            nf4.quantization_factor, nf4.scaler_mean))
    quantized = {id(linear.weight) for linear in adapted.values()}
    stored += sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values() if id(p) not in quantized)
    assert facts["base_bytes"] == pytest.approx(stored, rel=1e-6)


# A Qwen3-MoE whose attention projections split into whole NF4 blocks over 2 ranks (k_proj: 2 blocks)
MOE_NF4 = dict(vocab_size=8192, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
QLORA_RUN = ["task=sft", "model=hf", "finetune=qlora", "finetune.rank=4", "finetune.alpha=8",
             "finetune.targets=[q_proj,k_proj,v_proj,o_proj,experts]", "train.steps=5", "train.seq_len=32",
             "train.micro_batch_size=1", "train.global_batch_size=2", "optim.warmup_steps=0",
             "optim.schedule=constant", "optim.lr=1e-2", "hardware=cpu", "logging.progress_bar=false",
             "generate.num_samples=0", "train.eval_every=0", "train.log_every=1", "checkpoint.every=0"]


@pytest.mark.distributed
def test_qlora_under_fsdp2_follows_the_single_process_run(launch, save_tiny_hf, tmp_path):
    """The NF4 base (attention; the experts stay fp32 under their adapters) from a transformers checkpoint,
    sharded by FSDP2 over 2 ranks: the losses of 5 steps within 1e-4 (relative) of one process'."""
    import json

    save_tiny_hf(tmp_path / "hf", seed=5, **MOE_NF4)
    losses = {}
    for layout in ("single", "fsdp2"):
        run_dir = tmp_path / layout
        code, _, err = launch(run_dir, f"run_dir={run_dir}", *QLORA_RUN, f"checkpoint.load_hf={tmp_path / 'hf'}",
                              f"parallel={layout}", timeout=900)
        assert code == 0, err[-3000:]
        records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        losses[layout] = [r["loss"] for r in records if "loss" in r]
    assert len(losses["single"]) == 5 and losses["single"][-1] < losses["single"][0]
    assert len(losses["fsdp2"]) == len(losses["single"])
    for a, b in zip(losses["fsdp2"], losses["single"]):
        assert a == pytest.approx(b, rel=1e-4)


def test_qlora_layouts_other_than_fsdp2_are_refused_before_launch(launch, tmp_path):
    code, _, err = launch(tmp_path, "task=sft", "model=qwen3_tiny", "finetune=qlora", "hardware=cpu", "parallel=tp2")
    assert code == 2 and "finetune=qlora shards its NF4 base with FSDP2 only, not under parallel.tp=2" in err
    assert len([line for line in err.splitlines() if "finetune=qlora" in line]) == 1
