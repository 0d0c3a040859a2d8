"""task=grpo end to end: metrics and matched log-probabilities, bit-exact resume (the sampling included), and the
one-line errors of bad reward functions, bad prompts and bad settings (exit 2 before launch where knowable)."""

import json
import math
from pathlib import Path

import pytest
import torch
from test_train_loop import TINY, config, metrics, saved_model

from speedllm.errors import UserError
from speedllm.runtime import Runtime
from speedllm.tasks.grpo import run

pytestmark = pytest.mark.numerics

RL = ["task=grpo", "rl.prompts_per_step=4", "rl.group_size=4", "rl.max_new_tokens=6", "rl.temperature=1.0",
      "rl.rewards=[{_target_: test_grpo_task.vowels, weight: 1.0}, {_target_: speedllm.train.rewards.math_answer, "
      "weight: 0.5}]", "optim.lr=1e-2", "optim.warmup_steps=0"]


def vowels(prompts, completions, **columns):
    """A reward with a spread inside each group: the share of vowels in the completion's text."""
    texts = [c[-1]["content"] for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def raises(prompts, completions, **columns):
    raise ValueError("no answer key")


def too_few(prompts, completions, **columns):
    return [0.0] * (len(completions) - 1)


def nan_at_5(prompts, completions, **columns):
    return [math.nan if i == 5 else 0.0 for i in range(len(completions))]


def none_at_2(prompts, completions, **columns):
    return [None if i == 2 else 1.0 for i in range(len(completions))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Four steps in one go: KL to a frozen reference, 2 epochs x 2 mini-batches."""
    run_dir = tmp_path_factory.mktemp("straight")
    run(config(run_dir, *RL, "train.steps=4", "rl.kl_coef=0.05", "rl.ppo_epochs=2", "rl.mini_batches=2"), Runtime())
    return run_dir


def test_metrics_and_matched_logprobs(straight):
    records = metrics(straight)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["rl/logprob_diff"] <= 1e-5
        assert {"rl/reward", "rl/reward/vowels", "rl/reward/math_answer", "rl/kl", "rl/clip_frac", "rl/entropy",
                "rl/response_len", "rl/zero_adv_groups", "rl/rollout_tokens_per_s",
                "rl/update_tokens_per_s"} <= r.keys()
        assert r["rl/reward"] == pytest.approx(r["rl/reward/vowels"] + 0.5 * r["rl/reward/math_answer"], abs=1e-6)
        assert 1 <= r["rl/response_len"] <= r["rl/response_len_max"] <= 6
    assert all(r["rl/kl"] >= 0 for r in records) and records[-1]["rl/kl"] > 0  # the policy leaves the reference
    assert any(r["rl/clip_frac"] > 0 for r in records)  # the second epoch's ratios leave the clip range
    assert (straight / "tensorboard").is_dir()


def test_resume_is_bit_exact(straight, tmp_path):
    cfg = config(tmp_path, *RL, "train.steps=4", "rl.kl_coef=0.05", "rl.ppo_epochs=2", "rl.mini_batches=2",
                 "train.stop_after=2")
    run(cfg, Runtime())
    run(config(tmp_path, *RL, "train.steps=4", "rl.kl_coef=0.05", "rl.ppo_epochs=2", "rl.mini_batches=2",
               f"checkpoint.load={tmp_path}/checkpoints"), Runtime())
    def untimed(records):
        return [{k: v for k, v in r.items() if not k.endswith(("per_s", "step_s"))} for r in records]

    assert untimed(metrics(tmp_path)) == untimed(metrics(straight))
    ours, theirs = saved_model(tmp_path / "checkpoints" / "step_00000004"), saved_model(
        straight / "checkpoints" / "step_00000004")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("fn, message", [
    ("raises", r"rl.rewards: raises raised ValueError: no answer key \(on the completions of prompt \d+\) — fix"),
    ("too_few", r"rl.rewards: too_few returned 15 values for 16 completions — return one float per completion"),
    ("nan_at_5", r"rl.rewards: nan_at_5 returned nan for a completion of prompt \d+ \(row 5\)"),
    ("none_at_2", r"rl.rewards: none_at_2 returned None for a completion of prompt \d+ \(row 2\)"),
])
def test_a_bad_reward_function_is_one_line_and_saves_nothing(fn, message, tmp_path):
    cfg = config(tmp_path, *RL, "train.steps=2", f"rl.rewards=[{{_target_: test_grpo_task.{fn}}}]")
    with pytest.raises(UserError, match=message) as err:
        run(cfg, Runtime())
    assert "\n" not in str(err.value)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bad_prompts_and_settings_exit_2_before_launch(tmp_path, launch):
    no_prompt = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "1 + 1 =", "answer": "2"}, {"question": "2 + 2 ="}])
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "word " * 80, "answer": "1"}])
    cases = [
        (["rl.group_size=1"], "rl.group_size=1 must be >= 2 (with 1 every advantage would be zero"),
        ([f"data.input={no_prompt}"], f"{no_prompt}:2: no `prompt` field — task=grpo records need prompt"),
        ([f"data.input={long}", "model.max_position_embeddings=64"],
         f"{long}:1: the prompt is 82 tokens; with rl.max_new_tokens=6 it needs 88 positions, more than the "
         "model's 64"),
        (["rl.rewards=[{_target_: nowhere.fn}]"], "rl.rewards[0]._target_=nowhere.fn cannot be imported"),
        (["rl.tools=[{_target_: nowhere.fn}]"], "rl.tools[0]._target_=nowhere.fn cannot be imported"),
        (["rl.tool_timeout_s=0"], "rl.tool_timeout_s=0"),
        (["parallel=fsdp2", "rl.prompts_per_step=3"], "rl.prompts_per_step=3 must be divisible by parallel.dp=2"),
    ]
    for overrides, message in cases:
        code, out, err = launch(tmp_path / "run", *TINY, *RL, *overrides) if overrides == cases[0][0] else \
            (2, "", _validation_error(tmp_path, overrides))
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (overrides, err)
    assert not (tmp_path / "run").exists()  # refused before launch: no run directory


def _validation_error(tmp_path, overrides) -> str:
    from omegaconf import open_dict

    from speedllm.config import compose_config
    from speedllm.config.resolve import resolve_layout
    from speedllm.config.validate import validate

    cfg = compose_config(*TINY, *RL, *overrides, f"run_dir={tmp_path}/v")
    with open_dict(cfg):
        world, nproc = resolve_layout(cfg)
        with pytest.raises(UserError) as err:
            validate(cfg, world, nproc)
    return f"error: {err.value}"


def vowels_if_even(prompts, completions, answer, **columns):
    """vowels() for prompts whose answer is even, 0 for the others (their groups carry no advantage)."""
    return [v if int(a) % 2 == 0 else 0.0 for v, a in zip(vowels(prompts, completions), answer)]


def test_dynamic_sampling_replaces_groups_without_advantage(tmp_path):
    cfg = config(tmp_path, *RL, "train.steps=1", "rl.dynamic_sampling=true", "rl.max_resample=3",
                 "rl.rewards=[{_target_: test_grpo_task.vowels_if_even}]")
    run(cfg, Runtime())
    (record,) = metrics(tmp_path)
    assert 0 < record["rl/zero_adv_groups"] < 1  # the first rollout had groups to replace
    assert record["rl/zero_adv_groups_trained"] == 0  # and the update trained on none of them
    assert record["rl/response_len"] > 0 and record["loss"] != 0


def test_lora_reference_is_the_base_with_adapters_off(tmp_path):
    run(config(tmp_path, *RL, "train.steps=2", "rl.kl_coef=0.1", "finetune=lora", "finetune.rank=4"), Runtime())
    first, second = metrics(tmp_path)
    assert first["rl/kl"] == 0.0 and second["rl/kl"] > 0  # B = 0: the policy starts as the reference


def test_bf16_mixed_precision_samples_and_trains_under_autocast(tmp_path):
    """hardware.dtype=bfloat16 (what `auto` picks on a CPU with AMX or AVX512-BF16): the rollout runs under the
    training forward's autocast into a bf16 KV cache (it failed on mixed dtypes before), and its log-probabilities
    stay those of the bf16 training forward."""
    run(config(tmp_path, *RL, "train.steps=2", "hardware.dtype=bfloat16"), Runtime())
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["rl/logprob_diff"] <= 0.05 for r in records), records
