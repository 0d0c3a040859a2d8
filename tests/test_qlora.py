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

    losses = {}
    for mode in ("lora", "qlora"):
        cfg = config(tmp_path / mode, *TINY, *NF4_SIZES, *SFT, *LORA, f"finetune={mode}")
        seed_everything(cfg.seed)
        pm = build_model(cfg, Runtime())
        adapted = target_linears(pm.module, cfg.finetune.targets)
        full = {name: linear.weight.detach().clone() for name, linear in adapted.items()}
        load_base(pm.parts, cfg, None)
        if mode == "qlora":
            for name, linear in target_linears(pm.module, cfg.finetune.targets).items():
                assert type(linear.weight).__name__ == "NF4Tensor" and not linear.weight.requires_grad
                # the same NF4 as torchao's own quantization of the fp32 weight
                assert torch.equal(linear.weight.get_original_weight(), to_nf4(full[name]).get_original_weight())
        losses[mode] = steps(pm, cfg, 3)
    assert losses["qlora"][-1] < losses["qlora"][0]
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
