"""Optimizer groups, LR schedules, FLOPs/MFU against hand computations, the metric sinks, bad-step accounting."""

import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import Qwen3Config, Qwen3ForCausalLM

from speedllm.config import compose_config
from speedllm.errors import UserError
from speedllm.train.faults import BadSteps
from speedllm.train.metrics import MetricsLogger, flops_per_token, matmul_params_per_token, mfu, peak_devices
from speedllm.train.optimizer import build_optimizer
from speedllm.train.schedule import build_scheduler, lr_factor

pytestmark = pytest.mark.unit


def optim_cfg(**kw):
    base = dict(name="adamw", _target_="torch.optim.AdamW", _partial_=True, foreach=True, lr=1.0, min_lr=0.1, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8,
                schedule="cosine", warmup_steps=10, decay_fraction=0.2, decay_embeddings=False)
    return OmegaConf.create({**base, **kw})


def test_warmup_then_cosine_and_linear():
    for schedule in ("cosine", "linear"):
        o = optim_cfg(schedule=schedule)
        assert lr_factor(0, o, 110) == pytest.approx(0.1)  # first update: lr / warmup_steps
        assert lr_factor(9, o, 110) == pytest.approx(1.0)  # last warmup update: the peak
        assert lr_factor(59, o, 110) == pytest.approx(0.55)  # halfway through the decay: (1 + 0.1) / 2
        assert lr_factor(109, o, 110) == pytest.approx(0.1)  # last update: min_lr
    assert lr_factor(34, optim_cfg(schedule="cosine"), 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(34, optim_cfg(schedule="linear"), 110) == pytest.approx(1 - 0.9 * 0.25)
    assert lr_factor(50, optim_cfg(schedule="constant"), 110) == 1.0


def test_warmup_stable_decay():
    o = optim_cfg(schedule="wsd", warmup_steps=10, decay_fraction=0.2)  # 100 steps: stable to 80, decay to 100
    assert [lr_factor(s, o, 100) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]
    assert lr_factor(89, o, 100) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_factor(99, o, 100) == pytest.approx(0.1)


def test_scheduler_drives_the_optimizer():
    param = torch.nn.Parameter(torch.zeros(2, 2))
    o = optim_cfg(lr=2e-3, min_lr=0.0, warmup_steps=2, schedule="linear")
    optimizer = torch.optim.AdamW([param], lr=o.lr)
    scheduler = build_scheduler(optimizer, o, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([1e-3, 2e-3, 1.5e-3, 1e-3, 0.5e-3, 0.0])


@pytest.mark.parametrize("decay_embeddings", [False, True])
def test_weight_decay_groups_on_transformers_qwen3(decay_embeddings):
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                         tie_word_embeddings=False))
    optimizer = build_optimizer(model, optim_cfg(decay_embeddings=decay_embeddings))
    decayed, undecayed = optimizer.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed_names = {names[id(p)] for p in undecayed["params"]}
    expected = {n for n, _ in model.named_parameters() if "norm" in n}
    if not decay_embeddings:
        expected.add("model.embed_tokens.weight")
    assert undecayed_names == expected and undecayed["weight_decay"] == 0.0
    assert decayed["weight_decay"] == 0.1 and len(decayed["params"]) + len(undecayed["params"]) == len(names)
    assert "lm_head.weight" in {names[id(p)] for p in decayed["params"]}


def test_flops_and_mfu_match_hand_computation():
    dense = compose_config("model=qwen3_tiny").model
    # qwen3_tiny: h=256, head_dim=64, 4 heads / 2 kv heads, intermediate 768, 4 layers, vocab 8192
    #   attention 256*64*(2*4 + 2*2) = 196,608; mlp 3*256*768 = 589,824; 4 layers: 3,145,728
    #   output projection 8192*256 = 2,097,152  ->  N = 5,242,880
    assert matmul_params_per_token(dense) == 5_242_880
    # 6N = 31,457,280; causal attention 6 * 4 layers * 4 heads * 64 * 256 = 1,572,864
    assert flops_per_token(dense, 256) == 33_030_144
    # a measured step: 8 x 256 tokens in 2.0 s = 1024 tokens/s on 1 CPU with a 0.1 TFLOP/s fp32 peak
    assert mfu(8 * 256 / 2.0, 33_030_144, 0.1, 1) == pytest.approx(1024 * 33_030_144 / 1e11)
    assert mfu(8 * 256 / 2.0, 33_030_144, 0.1, 4) == pytest.approx(0.3382286746 / 4)
    # 4 ranks on one CPU share the cores its probe measured: one peak; on 4 GPUs, four; on 2 CPU nodes, two
    assert peak_devices(compose_config("hardware=cpu", "launcher.nproc_per_node=4"), 4) == 1
    assert peak_devices(compose_config("hardware=h100", "launcher.nproc_per_node=4"), 4) == 4
    assert peak_devices(compose_config("hardware=cpu", "launcher.nproc_per_node=2", "launcher.nnodes=2"), 4) == 2

    moe = compose_config("model=qwen3_moe_tiny").model
    # h=128, head_dim 32: attention 128*32*12 = 49,152; top-2 of 8 experts of 128: 2*3*128*128 = 98,304,
    # router 128*8 = 1,024; 4 layers: 593,920; output projection 8192*128 = 1,048,576
    assert matmul_params_per_token(moe) == 1_642_496
    assert flops_per_token(moe, 64) == 6 * 1_642_496 + 6 * 4 * 4 * 32 * 64


def test_metrics_jsonl_and_tensorboard(tmp_path):
    logger = MetricsLogger(str(tmp_path), total_steps=4, start_step=0, enabled=True, progress_bar=False)
    for step in (2, 4):
        logger.log(step, {"loss": 5.0 - step, "lr": 1e-3 * step, "mfu": 0.5})
    logger.log(4, {"loss": 1.5, "ppl": math.exp(1.5)}, prefix="valid")
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 2, "loss": 3.0, "lr": 2e-3, "mfu": 0.5}, {"step": 4, "loss": 1.0, "lr": 4e-3, "mfu": 0.5},
                       {"step": 4, "split": "valid", "loss": 1.5, "ppl": math.exp(1.5)}]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "train/lr", "train/mfu", "valid/loss", "valid/ppl"}
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(2, 3.0), (4, 1.0)]


def test_disabled_logger_writes_nothing(tmp_path):
    logger = MetricsLogger(str(tmp_path / "run"), total_steps=4, start_step=0, enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_bad_steps_stop_after_k_in_a_row():
    bad = BadSteps(max_in_a_row=3)
    for step, ok in enumerate([False, False, True, False, False], start=1):
        bad.record(ok, step)
    assert (bad.total, bad.in_a_row) == (4, 2)
    with pytest.raises(UserError, match=r"3 consecutive steps .*step 6.*train.max_bad_steps=3"):
        bad.record(False, 6)
