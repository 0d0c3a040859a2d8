"""speedllm.generation.rollout: the recorded log-probabilities against transformers' forward on the same tokens and
against our training forward, the MoE routes against transformers' router, router replay, per-prompt sampling."""

import pytest
import torch

from speedllm.generation.rollout import completion_logprobs, rollout
from speedllm.generation.sampling import Sampling
from speedllm.models.moe import replay_routes

pytestmark = pytest.mark.numerics

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
SAMPLING = Sampling(temperature=0.8, top_p=0.95)
STOPS = [7, 8, 9]


def sample(model, prompts, seeds, n=3):
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return rollout(model, prompts, n, 12, SAMPLING, generators, STOPS, 0, torch.float32)


def hf_logprobs(hf, ro, moe: bool):
    """transformers' log-probabilities of the completion tokens (and router logits) on the rollout's tokens."""
    out = hf(ro.tokens, attention_mask=ro.attention_mask, position_ids=ro.position_ids, output_router_logits=moe)
    P = ro.prompt_width
    logp = torch.log_softmax(out.logits[:, P - 1:-1].float() / SAMPLING.temperature, dim=-1)
    return logp.gather(-1, ro.tokens[:, P:, None]).squeeze(-1) * ro.completion_mask, out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_logprobs_match_transformers_and_our_training_forward(moe, hf_pair):
    _, hf, ours = hf_pair(seed=3, **(MOE if moe else {}))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 96, (n,), generator=gen).tolist() for n in (5, 9)]
    ro = sample(ours, prompts, [10, 11])
    lengths = ro.completion_mask.sum(dim=1)
    assert ro.tokens.shape == (6, 9 + lengths.max()) and ro.prompt_lens.tolist() == [5, 5, 5, 9, 9, 9]
    assert ro.truncated.tolist() == [len(ids) == 12 and ids[-1] not in STOPS for ids in ro.completion_ids()]
    for row, ids in zip(ro.tokens.tolist(), ro.completion_ids()):  # a row ends at its first stop id, kept
        assert not set(ids[:-1]) & set(STOPS) and (len(ids) == 12 or ids[-1] in STOPS)
        assert row[9 + len(ids):] == [0] * (ro.tokens.shape[1] - 9 - len(ids))

    expected, out = hf_logprobs(hf, ro, moe)
    torch.testing.assert_close(ro.logprobs, expected, rtol=0, atol=1e-5)
    trained, entropy = completion_logprobs(ours, ro, SAMPLING.temperature)
    torch.testing.assert_close(trained, ro.logprobs, rtol=0, atol=1e-5)
    assert bool((entropy > 0).any()) and bool((entropy[ro.completion_mask == 0] == 0).all())

    if moe:  # the experts the rollout recorded are transformers' router's top-2 of every fed token
        top = torch.stack([r.view(*ro.tokens.shape, -1) for r in out.router_logits]).topk(2, dim=-1).indices
        fed = ro.attention_mask.bool()
        fed[:, -1] = False
        assert torch.equal(top[:, fed], ro.routes[:, fed]) and bool((ro.routes[:, :, -1] == -1).all())
        with replay_routes(ours, ro.routes) as tapes:
            replayed, _ = completion_logprobs(ours, ro, SAMPLING.temperature)
        assert sum(int(t.changed) + int(t.replayed) for t in tapes) == 0 and torch.equal(replayed, trained)
        moved = ro.routes.clone()  # every token's first expert moved to another one
        moved[..., 0] = (moved[..., 0] + 1) % 4
        moved[..., 0] = torch.where(moved[..., 0] == moved[..., 1], (moved[..., 0] + 1) % 4, moved[..., 0])
        moved[ro.routes < 0] = -1
        with replay_routes(ours, moved) as tapes:
            forced, _ = completion_logprobs(ours, ro, SAMPLING.temperature)
        real_fed = ro.attention_mask.bool() & fed
        # the forward used the given experts (nothing changed from them), overriding the router on every token
        assert sum(int(t.changed) for t in tapes) == 0 and sum(int(t.replayed) for t in tapes) == 2 * int(real_fed.sum())
        assert not torch.allclose(forced, trained)
        with replay_routes(ours, moved, impose=False) as tapes:  # the router decides: every token departs
            free, _ = completion_logprobs(ours, ro, SAMPLING.temperature)
        assert sum(int(t.changed) for t in tapes) == 2 * int(real_fed.sum()) and torch.equal(free, trained)
        assert sum(int(t.replayed) for t in tapes) == 0


def test_a_prompt_samples_the_same_whatever_shares_its_batch(hf_pair):
    _, _, ours = hf_pair(seed=4)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, 96, (n,), generator=gen).tolist() for n in (3, 7, 4)]
    together = sample(ours, prompts, [20, 21, 22])
    alone = sample(ours, prompts[1:2], [21])
    assert alone.completion_ids() == together.completion_ids()[3:6]
    assert len(set(map(tuple, together.completion_ids()))) > 3  # the draws differ between completions


def test_draw_samples_the_distribution_and_never_a_zero_probability_token():
    from speedllm.generation.sampling import draw

    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]).repeat(10000, 1)
    tokens = draw(probs, torch.Generator().manual_seed(0)).view(10000, 2)
    freq = torch.bincount(tokens[:, 0], minlength=5) / 10000
    assert (freq - probs[0]).abs().max() < 0.015 and freq[1] == freq[4] == 0  # 3 standard errors: 0.015
    assert (tokens[:, 1] == 4).all()
