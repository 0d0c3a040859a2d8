"""task=grpo when the rollout's log-probabilities and the training forward's differ: rl.old_logprobs=recompute and
the rollout correction (TIS, MIS) held against the published formulas on fixed inputs, and the keys end to end."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from test_grpo_task import _validation_error
from test_train_loop import TINY, metrics

from speedllm.config.schema import RLConfig
from speedllm.train.policy_loss import policy_loss, rollout_correction

pytestmark = pytest.mark.unit

# two completions of three tokens, the second one token shorter; log-probabilities of the training forward (old)
# and the rollout, with ratios exp(old - rollout) of 3, 0.3, e^-0.1 and e^0.4, 2.5 (and a padding column)
OLD = [[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]]
ROLLOUT = [[-1.0 - math.log(3.0), -2.0 - math.log(0.3), -0.5 + 0.1], [-0.2 - 0.4, -3.0 - math.log(2.5), 0.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
C = 2.0


def published_weights(mode: str) -> tuple:
    """verl's rollout correction written out per token (docs/algo/rollout_corr_math.md, §3.3.1 and §3.4):
    ρ = π_old / π_rollout; TIS w = min(ρ, C); MIS (token IS + token RS) w = ρ, kept iff 1/C ≤ ρ ≤ C."""
    weights, kept = [], []
    for old_row, rollout_row, mask_row in zip(OLD, ROLLOUT, MASK):
        w_row, k_row = [], []
        for old, rollout, m in zip(old_row, rollout_row, mask_row):
            rho = math.exp(old - rollout)
            if m == 0:
                w_row.append(0.0), k_row.append(0.0)
            elif mode == "tis":
                w_row.append(min(rho, C)), k_row.append(1.0)
            else:
                keep = 1 / C <= rho <= C
                w_row.append(rho if keep else 0.0), k_row.append(float(keep))
        weights.append(w_row), kept.append(k_row)
    return weights, kept


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_weights_and_loss_follow_the_published_formulas(mode):
    t = torch.tensor
    weights, mask, corrected = rollout_correction(t(OLD), t(ROLLOUT), t(MASK), mode, C)
    expected_w, expected_kept = published_weights(mode)
    assert torch.allclose(weights, t(expected_w), rtol=1e-6, atol=0)
    assert mask.tolist() == expected_kept
    assert float(corrected) == {"tis": 2, "mis": 3}[mode]  # TIS truncates 3 and 2.5; MIS drops 0.3 too

    # the PPO loss (seq_mean, no KL) of a policy a little off the old one, each token's clipped term weighted
    rl = OmegaConf.merge(OmegaConf.structured(RLConfig), {"clip_low": 0.2, "clip_high": 0.2})
    policy = [[o + d for o, d in zip(row, (0.1, -0.3, 0.25))] for row in OLD]
    advantages = [1.0, -0.5]
    loss, _ = policy_loss(t(policy) * mask, t(OLD), None, t(advantages), mask, rl, 2.0, float(mask.sum()), weights)
    rows = []
    for p_row, o_row, w_row, k_row, a in zip(policy, OLD, expected_w, expected_kept, advantages):
        terms = []
        for p, o, w, k in zip(p_row, o_row, w_row, k_row):
            if k:
                r = math.exp(p - o)
                terms.append(-w * min(r * a, max(min(r, 1.2), 0.8) * a))
        rows.append(sum(terms) / len(terms))
    assert float(loss) == pytest.approx(sum(rows) / 2, rel=1e-6)


def test_recompute_and_correction_run_end_to_end(tmp_path, launch_here):
    """Two steps with the old policy recomputed: the rollout's decode steps and the training forward round apart by
    ~1e-7 in float32, so MIS at C = 1 + 1e-7 drops some of the tokens; the metrics say so."""
    launch_here(tmp_path, *TINY, "task=grpo", "train.steps=2", "rl.prompts_per_step=2", "rl.group_size=2",
                "rl.max_new_tokens=4", "rl.old_logprobs=recompute", "rl.rollout_correction=mis",
                "rl.rollout_correction_threshold=1.0000001")
    for record in metrics(tmp_path):
        assert 0 < record["rl/logprob_diff_mean"] <= record["rl/logprob_diff"] <= 1e-5
        assert 0 < record["rl/rollout_is_clip_frac"] < 1


@pytest.mark.parametrize("overrides, message", [
    (["rl.rollout_correction=tis"], "rl.rollout_correction=tis weighs the training forward's old log-probabilities "
     "against the rollout's; add rl.old_logprobs=recompute"),
    (["rl.rollout_correction=is"], "rl.rollout_correction=is"),
    (["rl.old_logprobs=recompute", "rl.rollout_correction=mis", "rl.rollout_correction_threshold=1"],
     "rl.rollout_correction_threshold=1"),
])
def test_bad_settings_are_one_line_before_launch(overrides, message, tmp_path):
    err = _validation_error(tmp_path, overrides)
    assert message in err and "\n" not in err.strip()
