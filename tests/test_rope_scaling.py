"""RoPE scaling (YaRN, linear, dynamic NTK) held against transformers' Qwen3 beyond the native length.

A tiny transformers Qwen3 saved with a scaled rope in config.json loads through checkpoint.load_hf's path
(config fields + weights); logits at positions past original_max_position_embeddings and 200 greedy tokens
must equal transformers'.
"""

import pytest
import torch
from test_hf import our_model, save_hf

from speedllm.errors import UserError
from speedllm.generation.engine import generate_ids
from speedllm.generation.sampling import Sampling
from speedllm.models.hf_adapter import hf_config_dict, model_config_from_hf

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
SCALINGS = {
    "yarn": YARN,
    "linear": {"rope_type": "linear", "factor": 4.0},
    # dynamic NTK only changes anything beyond max_position_embeddings, so the model's is the short one
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
}


def saved(tmp_path, kind):
    native = 64 if kind == "dynamic" else 256
    return save_hf("dense_tied", tmp_path / kind, max_position_embeddings=native,
                   rope_parameters={**SCALINGS[kind], "rope_theta": 10000.0})


@pytest.mark.parametrize("kind", SCALINGS)
def test_scaled_rope_logits_equal_transformers_beyond_native_length(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    path = saved(tmp_path, kind)
    ours = our_model(path)
    assert ours.cfg.rope_scaling["rope_type"] == kind
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours_logits, ref_logits = ours(tokens), reference(tokens).logits
    assert (ours_logits[:, 64:] - ref_logits[:, 64:]).abs().max().item() <= 1e-5
    # the scaling is really in effect: plain RoPE gives other logits past the native length
    ours.cfg.rope_scaling = None
    plain = type(ours)(ours.cfg)
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (plain(tokens)[:, 64:] - ref_logits[:, 64:]).abs().max().item() > 1e-3


def test_yarn_greedy_200_tokens_identical_and_bounded_by_max_positions(tmp_path):
    from transformers import AutoModelForCausalLM

    path = saved(tmp_path, "yarn")
    ours = our_model(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    expected = reference.generate(prompt, max_new_tokens=200, do_sample=False, pad_token_id=0,
                                  eos_token_id=None)[0, 8:].tolist()
    got = generate_ids(ours, prompt.tolist(), 200, Sampling(), [], 0, torch.float32)[0]
    assert len(got) == 200 and got == expected
    # generation stops where the sequence reaches max_position_embeddings (256)
    assert len(generate_ids(ours, prompt.tolist(), 400, Sampling(), [], 0, torch.float32)[0]) == 256 - 8


def test_rope_scaling_exports_as_rope_parameters_and_rejects_unknown_types():
    cfg = model_config_from_hf({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                "num_hidden_layers": 1, "num_attention_heads": 1, "max_position_embeddings": 128,
                                "rope_scaling": {"type": "yarn", "factor": 2.0}, "rope_theta": 1e4})
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}

    class Cfg:  # the fields hf_config_dict reads
        vocab_size = hidden_size = intermediate_size = num_hidden_layers = num_attention_heads = 8
        num_key_value_heads, head_dim, max_position_embeddings, rope_theta = 8, 8, 128, 1e4
        rms_norm_eps, tie_word_embeddings, initializer_range, num_experts = 1e-6, False, 0.02, 0
        rope_scaling, attention_output_gate = YARN, False

    assert hf_config_dict(Cfg)["rope_parameters"] == {**YARN, "rope_theta": 1e4}
    with pytest.raises(UserError, match="rope_type 'longrope' is not supported"):
        model_config_from_hf({**cfg, "model_type": "qwen3", "num_attention_heads": 1,
                              "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})
