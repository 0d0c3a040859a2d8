"""Qwen3 (dense + MoE) against transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM on tiny random configs."""

import copy
import json

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from speedllm.models import KVCache, Qwen3, num_params
from speedllm.models.kv_cache import cache_shape
from speedllm.models.config import ModelConfig
from speedllm.models.hf_adapter import from_hf_state_dict, hf_config, model_config_from_hf, to_hf_state_dict
from speedllm.paths import CONF

pytestmark = pytest.mark.numerics

VOCAB = 96  # conftest.TINY_MODEL's


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.01)
CONFIGS = {
    "dense_tied": dict(tie_word_embeddings=True),
    "dense_untied": dict(tie_word_embeddings=False),
    "moe_norm_topk": dict(**MOE, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]),
    "moe_no_norm_topk": dict(**MOE, norm_topk_prob=False, tie_word_embeddings=True),
}


@pytest.mark.parametrize("ops", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_logits_loss_grads(name, ops, hf_pair):
    cfg, hf, ours = hf_pair(ops=ops, **CONFIGS[name])
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() <= 1e-5

    out = hf(tokens, labels=tokens, output_router_logits=bool(cfg.num_experts))
    out.loss.backward()
    labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)  # ours takes labels already shifted
    ours.loss_chunk_size = 7  # several chunks, the last one partial
    ce_sum, aux = ours(tokens, labels=labels)
    loss = ce_sum / (labels != -100).sum() + aux
    loss.backward()
    assert abs(loss.item() - out.loss.item()) <= 1e-6
    if cfg.num_experts:
        assert aux.item() > 0
        assert abs(aux.item() - cfg.router_aux_loss_coef * out.aux_loss.item()) <= 1e-7

    hf_grads = from_hf_state_dict({n: p.grad for n, p in hf.named_parameters()}, cfg)
    ours_params = dict(ours.named_parameters(remove_duplicate=False))
    assert set(hf_grads) == set(ours_params)
    for n, p in ours_params.items():
        assert (p.grad - hf_grads[n]).abs().max() <= 1e-5, n


def greedy(model, prompt, max_new_tokens, attention_mask=None):
    """Greedy decoding with our static KV cache: one prefill, then one token per step."""
    B, S = prompt.shape
    cache = KVCache(cache_shape(model.cfg), B, S + max_new_tokens, torch.float32)
    mask = torch.ones_like(prompt) if attention_mask is None else attention_mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens, out = prompt, []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(tokens, position_ids=positions, attention_mask=mask, kv_cache=cache)
            tokens = logits[:, -1:].argmax(-1)
            out.append(tokens)
            positions = positions[:, -1:] + 1
            mask = torch.ones_like(tokens)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", ["dense_untied", "moe_norm_topk"])
def test_greedy_generation_matches_hf_generate(name, hf_pair):
    cfg, hf, ours = hf_pair(seed=3, **CONFIGS[name])
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    expected = hf.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)[:, 9:]
    assert expected.shape[1] == 32
    assert torch.equal(greedy(ours, prompt, 32), expected)


def test_left_padded_batch_generation_matches_hf_generate(hf_pair):
    cfg, hf, ours = hf_pair(seed=5, **CONFIGS["dense_tied"])
    prompt = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    prompt[1, :3] = 0
    expected = hf.generate(prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)[:, 8:]
    assert torch.equal(greedy(ours, prompt, 12, attention_mask=mask), expected)


@pytest.mark.parametrize("name", ["dense_untied", "moe_norm_topk"])
def test_packed_documents_equal_separate_runs(name, hf_pair):
    cfg, _, ours = hf_pair(**CONFIGS[name])
    lengths = [5, 8, 3]
    docs = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    document_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        together = ours(packed, position_ids=position_ids, document_ids=document_ids)
        separate = torch.cat([ours(doc) for doc in docs], dim=1)
    assert (together - separate).abs().max() <= 1e-5


def test_pipeline_style_stages_reproduce_full_model(hf_pair):
    cfg, _, ours = hf_pair(**CONFIGS["moe_norm_topk"])
    first, last = copy.deepcopy(ours), copy.deepcopy(ours)
    first.norm = first.lm_head = None
    del first.layers["2"]
    last.embed_tokens = None
    del last.layers["0"], last.layers["1"]
    tokens = torch.randint(0, VOCAB, (2, 10))
    labels = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        h, moe_stats = first(tokens)  # a MoE stage passes the running load-balancing statistics on
        assert torch.equal(last(h, moe_stats=moe_stats), ours(tokens))
        ce_sum, aux = last(h, labels=labels, moe_stats=moe_stats)
        ref_ce_sum, ref_aux = ours(tokens, labels=labels)
    assert aux > 0 and torch.equal(aux, ref_aux) and torch.equal(ce_sum, ref_ce_sum)


def test_meta_init_matches_direct_init(tiny_model_cfg):
    cfg = tiny_model_cfg(**CONFIGS["moe_norm_topk"])
    direct = Qwen3(cfg)
    direct.init_weights(seed=7)
    with torch.device("meta"):
        meta = Qwen3(cfg)
    meta.to_empty(device="cpu")
    meta.init_weights(seed=7)
    assert meta.lm_head.weight is not meta.embed_tokens.weight
    for (n, a), b in zip(direct.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), n
    std = torch.cat([p.flatten() for n, p in meta.named_parameters() if "norm" not in n]).std().item()
    assert abs(std - cfg.initializer_range) < 1e-3
    assert all(torch.all(p == 1) for n, p in meta.named_parameters() if "norm" in n)
    tied = Qwen3(tiny_model_cfg(tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.embed_tokens.weight


def model_sizes():
    """conf/model files that fix a size (model=hf takes every field from a checkpoint's config.json instead)."""
    paths = sorted((CONF / "model").glob("*.yaml"))
    return [p for p in paths if not OmegaConf.is_interpolation(OmegaConf.load(p), "hidden_size")]


@pytest.mark.parametrize("path", model_sizes(), ids=lambda p: p.stem)
def test_param_count_matches_transformers_on_meta(path):
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    config = hf_config(cfg)
    with torch.device("meta"):
        ours = Qwen3(cfg)
        hf = getattr(transformers, config.architectures[0])(config)  # Qwen3, Qwen3-MoE, Qwen3.5, Qwen3-Next
    hf_total = sum(p.numel() for p in hf.parameters())  # transformers' parameters() skips the tied copy
    assert num_params(ours) == hf_total
    if cfg.num_experts:
        hf_experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
        hf_active = hf_total - hf_experts + hf_experts * cfg.num_experts_per_tok // cfg.num_experts
        assert num_params(ours, activated=True) == hf_active
    else:
        assert num_params(ours, activated=True) == hf_total


@pytest.mark.parametrize("name", ["dense_tied", "moe_no_norm_topk"])
def test_hf_export_loads_in_transformers(name, tmp_path, hf_pair):
    """to_hf_state_dict + hf_config -> a directory transformers loads with the same logits; config reads back."""
    cfg, _, ours = hf_pair(**CONFIGS[name])
    hf_config(cfg).save_pretrained(tmp_path)
    hf_sd = to_hf_state_dict(ours.state_dict(), cfg)
    assert "lm_head.weight" not in hf_sd  # tied
    if cfg.num_experts:
        expert_down = hf_sd["model.layers.1.mlp.experts.3.down_proj.weight"]
        assert expert_down.shape == (cfg.hidden_size, cfg.moe_intermediate_size)
    save_file({k: v.contiguous() for k, v in hf_sd.items()}, tmp_path / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        assert (loaded(tokens).logits - ours(tokens)).abs().max() <= 1e-5
    back = from_hf_state_dict(to_hf_state_dict(ours.state_dict(), cfg), cfg)
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())

    read = model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    for key, value in read.items():
        assert value == cfg[key], key


def test_model_config_from_hf_reads_transformers4_spelling():
    config = dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=4, rope_theta=1e6, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=4, norm_topk_prob=True)
    read = model_config_from_hf(config)
    assert read["rope_theta"] == 1e6 and read["num_experts"] == 8 and read["norm_topk_prob"] is True
    config = dict(config, model_type="qwen3_moe", rope_parameters={"rope_type": "default", "rope_theta": 5e6},
                  num_local_experts=16)
    del config["rope_theta"], config["num_experts"]
    read = model_config_from_hf(config)
    assert read["rope_theta"] == 5e6 and read["num_experts"] == 16


@pytest.mark.parametrize("ops", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["dense_untied", "moe_no_norm_topk"])
def test_op_set_model_matches_reference(name, ops, hf_pair):
    """The model on the cpu and cuda op sets (the cuda one is pure torch, runs on CPU too) gives the reference
    model's loss and grads."""
    cfg, _, ref = hf_pair(**CONFIGS[name])
    fused = Qwen3(cfg, ops=ops)
    fused.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 16))
    document_ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    losses = []
    for model in (ref, fused):
        ce_sum, aux = model(tokens, labels=tokens, document_ids=document_ids)
        (ce_sum + aux).backward()
        losses.append(ce_sum + aux)
    assert abs(losses[0].item() - losses[1].item()) <= 1e-4
    for (n, a), b in zip(ref.named_parameters(), fused.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-5, n
