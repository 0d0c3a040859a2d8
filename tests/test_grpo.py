"""task=grpo: the policy loss and its gradients against TRL's GRPOTrainer (its own compute_loss on the same HF
weights and inputs) for its loss types grpo, dr_grpo, dapo (with and without KL) and GSPO."""

import pytest
import torch
from omegaconf import OmegaConf

from speedllm.config.schema import RLConfig
from speedllm.generation.rollout import Rollout, completion_logprobs
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import from_hf_state_dict, model_config_from_hf, to_hf_state_dict
from speedllm.models.qwen3 import Qwen3
from speedllm.train.policy_loss import group_advantages, policy_loss

pytestmark = pytest.mark.numerics

B, P, C, GROUP, TEMPERATURE = 4, 5, 8, 4, 0.7
# TRL loss_type / importance level -> our rl settings
CASES = {
    "grpo": ("grpo", "token", dict(loss_agg="seq_mean")),
    "dr_grpo": ("dr_grpo", "token", dict(loss_agg="constant", advantage_std_norm=False)),
    "dapo": ("dapo", "token", dict(loss_agg="token_mean")),
    "gspo": ("grpo", "sequence", dict(loss_agg="seq_mean", importance="sequence")),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, save_tiny_hf):
    """A tiny Qwen3 saved by transformers with the demo tokenizer, which TRL loads as policy and reference."""
    path = tmp_path_factory.mktemp("trl")
    save_tiny_hf(path, seed=3, vocab_size=8192)
    return path


def trl_trainer(path, loss_type: str, importance: str, beta: float):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(path / "out"), per_device_train_batch_size=B, num_generations=GROUP,
                      max_completion_length=C, loss_type=loss_type, importance_sampling_level=importance, beta=beta,
                      epsilon=0.2, epsilon_high=0.28, temperature=TEMPERATURE, report_to="none", use_cpu=True,
                      bf16=False)
    trainer = GRPOTrainer(model=str(path), reward_funcs=lambda prompts, completions, **kw: [0.0] * len(prompts),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["a"] * B}),
                          processing_class=AutoTokenizer.from_pretrained(str(path)))
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets before compute_loss
    trainer.model.train()
    return trainer


def crafted_inputs(model):
    """Prompts of one length (transformers counts positions from the first column), completions of different
    lengths, rewards with one all-equal group, old and reference log-probs near the policy's."""
    gen = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(10, 8000, (B, P), generator=gen)
    completion_ids = torch.randint(10, 8000, (B, C), generator=gen)
    completion_mask = (torch.arange(C) < torch.tensor([8, 5, 3, 7])[:, None]).float()
    ro = Rollout(tokens=torch.cat([prompt_ids, completion_ids], 1),
                 attention_mask=torch.cat([torch.ones(B, P), completion_mask], 1).long(),
                 position_ids=torch.arange(P + C).expand(B, -1), prompt_lens=torch.full((B,), P),
                 completion_mask=completion_mask, logprobs=torch.zeros(B, C),
                 truncated=torch.zeros(B, dtype=torch.bool))
    with torch.no_grad():
        logprobs, _ = completion_logprobs(model, ro, TEMPERATURE)
    old = (logprobs + 0.3 * torch.randn(B, C, generator=gen)) * completion_mask
    ref = (logprobs + 0.2 * torch.randn(B, C, generator=gen)) * completion_mask
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    return ro, old, ref, rewards


@pytest.mark.parametrize("kl", [0.0, 0.04], ids=["no_kl", "kl"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradients_equal_trl_grpo_trainer(case, kl, hf_dir, tmp_path):
    loss_type, importance, settings = CASES[case]
    trainer = trl_trainer(hf_dir, loss_type, importance, kl)
    hf = trainer.model
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), model_config_from_hf(hf.config.to_dict()))
    ours = Qwen3(cfg)
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), cfg))
    rl = OmegaConf.merge(OmegaConf.structured(RLConfig), dict(kl_coef=kl, clip_low=0.2, clip_high=0.28,
                                                               max_new_tokens=C, group_size=GROUP, **settings))
    ro, old, ref, rewards = crafted_inputs(ours)
    advantages = group_advantages(rewards, GROUP, rl.advantage_std_norm)

    inputs = dict(prompt_ids=ro.tokens[:, :P], prompt_mask=torch.ones(B, P, dtype=torch.long),
                  completion_ids=ro.tokens[:, P:], completion_mask=ro.completion_mask.long(), advantages=advantages,
                  old_per_token_logps=old, ref_per_token_logps=ref, num_items_in_batch=ro.completion_mask.sum())
    expected = trainer.compute_loss(hf, inputs)
    expected.backward()

    logprobs, entropy = completion_logprobs(ours, ro, TEMPERATURE)
    loss, stats = policy_loss(logprobs, old, ref if kl else None, advantages, ro.completion_mask, rl,
                              num_rows=B, num_tokens=float(ro.completion_mask.sum()))
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    theirs = dict(hf.named_parameters())
    for name, grad in to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, cfg).items():
        want = theirs[name].grad
        assert (grad - want).abs().max() <= 1e-5 * want.abs().max(), name

    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    tokens = float(stats[2])
    assert float(entropy.sum()) / tokens == pytest.approx(metrics["entropy"], rel=1e-5)
    if kl:
        assert float(stats[0]) / tokens == pytest.approx(metrics["kl"], rel=1e-5)
    if importance == "token":
        assert float(stats[1]) / tokens == pytest.approx(metrics["clip_ratio/region_mean"], abs=1e-7)
        assert metrics["clip_ratio/region_mean"] > 0 or case == "dr_grpo"


def test_group_advantages_are_trl_s():
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0])
    mean = rewards.view(-1, 4).mean(1).repeat_interleave(4)
    std = nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    torch.testing.assert_close(group_advantages(rewards, 4, True), (rewards - mean) / (std + 1e-4))
    torch.testing.assert_close(group_advantages(rewards, 4, False), rewards - mean)



@pytest.mark.parametrize("layout", [dict(dp=1), dict(dp=2), dict(tp=2)])
def test_planner_counts_the_rollout_cache_and_the_reference(layout):
    """task=grpo's plan: a rank's sampling phase holds the KV cache the rollout allocates (new_cache for its share
    of prompts_per_step x group_size rows of the longest prompt plus rl.max_new_tokens) and, with rl.kl_coef, the
    frozen reference copy of the weights; task=pretrain's plan has neither."""
    from speedllm.config import compose_config
    from speedllm.data.prompts import load_prompts
    from speedllm.data.tokenizer import load_tokenizer
    from speedllm.generation.engine import new_cache
    from speedllm.planner.layout import Layout
    from speedllm.planner.search import Planner, problem_from_config
    from speedllm.tasks import task_spec

    run = ["hardware=cpu", "hardware.dtype=float32", "model=qwen3_tiny", "rl.prompts_per_step=6", "rl.group_size=4"]
    world = max(layout.values())
    grpo = compose_config("task=grpo", "rl.kl_coef=0.05", *run)
    planner = Planner(problem_from_config(grpo, world, task_spec("grpo")))
    (memory,) = planner.rank_memories(Layout(**layout, micro_batch=24 // layout.get("dp", 1)))
    (plain,) = Planner(problem_from_config(compose_config(*run), world)).rank_memories(Layout(**layout))
    prompts = load_prompts(grpo.data.input, load_tokenizer(grpo.data.tokenizer), 4096, grpo.rl.max_new_tokens)
    length = max(len(ids) for ids in prompts.ids) + grpo.rl.max_new_tokens
    assert (planner.p.seq_len, planner.p.global_batch) == (length, 24)
    cache = new_cache(grpo.model, 24 // layout.get("dp", 1), length, torch.float32, "meta", layout.get("tp", 1))
    assert memory.rollout == (cache.k.nbytes + cache.v.nbytes) > 0 and plain.rollout == 0
    # the reference: the model's own fp32 weights, and under FSDP2 its root unit (embedding, final norm) gathered
    m = grpo.model
    root = 4 * (m.vocab_size * m.hidden_size + m.hidden_size) if layout.get("dp", 1) > 1 else 0
    assert memory.teacher == memory.params + root and plain.teacher == 0
    assert memory.sampling == memory.params + memory.optimizer + memory.teacher + memory.rollout


def test_math_closeness_gives_partial_credit_by_distance():
    from speedllm.train.rewards import math_closeness

    completions = ["<think>\n\n</think>\n\n53", "no number", [{"role": "assistant", "content": "55"}], "\\boxed{1/2}",
                   "<think>\n7\n</think>\n\n-45"]
    assert math_closeness(None, completions, ["55", "55", "55", "0.5", "55"]) == [1 / 3, 0.0, 1.0, 1.0, 1 / 101]
