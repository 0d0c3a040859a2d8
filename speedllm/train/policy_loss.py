"""The clipped policy-gradient loss of task=grpo; GRPO, Dr. GRPO, DAPO and GSPO are settings of it, not forks.

Per completion token t of row i, with advantage A_i, ratio r = exp(log π(t) − log π_old(t)) (or for
rl.importance=sequence, GSPO, one ratio per row: exp of the row's mean log-ratio):
    loss_t = −min(r A_i, clip(r, 1 − clip_low, 1 + clip_high) A_i) + kl_coef · r · KL_t
    KL_t   = exp(ref − logp) − (ref − logp) − 1          (Schulman's k3 estimator, as TRL)
(the ratio r on the KL term makes its gradient the unbiased reverse-KL gradient, DeepSeek-V3.2; TRL's default
use_bias_correction_kl)
aggregated over the tokens of a mini-batch by rl.loss_agg:
    seq_mean    mean over rows of each row's token mean              GRPO (TRL loss_type=grpo)
    token_mean  sum over tokens / number of tokens                   DAPO (loss_type=dapo)
    constant    sum over tokens / (rows x rl.max_new_tokens)         Dr. GRPO (loss_type=dr_grpo)
Advantages are group-relative (`group_advantages`): a reward minus its group's mean, divided by the group's std
(+1e-4) when rl.advantage_std_norm (Dr. GRPO turns it off). The formulas are TRL's GRPOTrainer (tests/test_grpo.py
checks loss and gradients against its code).

When the rollout's log-probabilities differ from the training forward's (bf16, another kernel), rl.old_logprobs=
recompute takes the old policy from a training forward before the update, and rl.rollout_correction weighs each
token by verl's rollout correction (`rollout_correction`) of ρ = exp(old − rollout), the training forward's
probability over the rollout's, with threshold C:
    tis   w = min(ρ, C)                                    truncated IS (verl rollout_is=token)
    mis   w = ρ, tokens with ρ outside [1/C, C] masked out   masked IS (verl rollout_is=token, rollout_rs=token)
and loss_t becomes w · (the clipped term) + the KL term; masked tokens leave the loss and its token counts.

The counts in the denominators are the whole mini-batch's (every data-parallel rank's rows), so each rank's
loss is its share of one sum and the gradient reduction adds the shares: any layout gives the same update.

Letters: N rows (completions), C completion columns, G completions per prompt.
"""

import torch


def group_advantages(rewards_N: torch.Tensor, group_size: int, std_norm: bool) -> torch.Tensor:
    """Each reward minus the mean of its group (G consecutive rows), over the group's std + 1e-4 if std_norm."""
    rewards_PG = rewards_N.view(-1, group_size)
    advantages_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if std_norm:
        advantages_PG = advantages_PG / (rewards_PG.std(dim=1, keepdim=True) + 1e-4)
    return advantages_PG.reshape(-1)


def rollout_correction(old_NC, rollout_NC, mask_NC, mode: str, threshold: float) -> tuple:
    """(weights [N, C], mask [N, C], corrected tokens: truncated or masked out) of verl's rollout correction
    `mode` (none | tis | mis) with threshold C; see the module docstring."""
    ratio_NC = torch.exp(old_NC - rollout_NC) * mask_NC
    if mode == "tis":
        return ratio_NC.clamp(max=threshold), mask_NC, ((ratio_NC > threshold) * mask_NC).sum()
    if mode == "mis":
        kept_NC = mask_NC * ((ratio_NC >= 1 / threshold) & (ratio_NC <= threshold))
        return ratio_NC * kept_NC, kept_NC, (mask_NC - kept_NC).sum()
    return torch.ones_like(mask_NC), mask_NC, torch.zeros(())


def policy_loss(logprobs_NC, old_NC, ref_NC, advantages_N, mask_NC, rl, num_rows: float, num_tokens: float,
                weights_NC=None) -> tuple:
    """(this rank's share of the mini-batch loss, statistics [KL sum, clipped tokens, tokens]) of its rows.

    Args:
        logprobs_NC: the policy's log-probabilities (with gradient); old_NC: the rollout's (the policy that
            sampled); ref_NC: the reference model's, or None when rl.kl_coef is 0. All float32, masked by mask_NC.
        rl: the rl config (clip_low, clip_high, importance, loss_agg, kl_coef, max_new_tokens).
        num_rows, num_tokens: rows and completion tokens of the whole mini-batch (all data-parallel ranks).
        weights_NC: the rollout correction's weights of the clipped term (rollout_correction), or None.
    """
    log_ratio_NC = logprobs_NC - old_NC
    if rl.importance == "sequence":
        log_ratio_NC = ((log_ratio_NC * mask_NC).sum(dim=1) / mask_NC.sum(dim=1).clamp(min=1.0)).unsqueeze(1)
    ratio = torch.exp(log_ratio_NC)
    advantages_N1 = advantages_N.unsqueeze(1)
    clipped_ratio = torch.clamp(ratio, 1 - rl.clip_low, 1 + rl.clip_high)
    token_loss_NC = -torch.min(ratio * advantages_N1, clipped_ratio * advantages_N1)
    if weights_NC is not None:
        token_loss_NC = token_loss_NC * weights_NC
    kl_sum = torch.zeros((), device=mask_NC.device)
    if rl.kl_coef != 0.0:
        delta_NC = ref_NC - logprobs_NC
        kl_NC = (torch.exp(delta_NC) - delta_NC - 1) * ratio
        token_loss_NC = token_loss_NC + rl.kl_coef * kl_NC
        kl_sum = (kl_NC.detach() * mask_NC).sum()
    if rl.loss_agg == "seq_mean":
        loss = ((token_loss_NC * mask_NC).sum(dim=1) / mask_NC.sum(dim=1).clamp(min=1.0)).sum() / num_rows
    elif rl.loss_agg == "token_mean":
        loss = (token_loss_NC * mask_NC).sum() / num_tokens
    else:  # constant
        loss = (token_loss_NC * mask_NC).sum() / (num_rows * rl.max_new_tokens)
    with torch.no_grad():
        clipped_NC = ((ratio < 1 - rl.clip_low) & (advantages_N1 < 0)) | \
            ((ratio > 1 + rl.clip_high) & (advantages_N1 > 0))
        clipped = (clipped_NC.float().expand_as(mask_NC) * mask_NC).sum()
    return loss, torch.stack([kl_sum, clipped, mask_NC.sum()])
