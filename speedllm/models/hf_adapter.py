"""Map between our state-dict names and transformers' Qwen3 / Qwen3-MoE ones, and between configs.

Ours: `embed_tokens.weight`, `layers.N.…`, `norm.weight`, `lm_head.weight`, stacked experts
`layers.N.mlp.experts.{gate,up,down}_proj` [E, out, in]. HF: the same under `model.` (except `lm_head`),
experts one Linear each on disk (`mlp.experts.{i}.{gate,up,down}_proj.weight`); transformers 5 holds them
in memory fused (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]). Tied embeddings
have no `lm_head.weight` in an HF checkpoint.
"""

import re
from typing import Dict

import torch

from speedllm.errors import UserError
from speedllm.models.rope import rope_scaling_from_hf

_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def to_hf_state_dict(sd: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """Our state dict -> HF checkpoint names (per-expert weights, no lm_head when tied), as save_pretrained writes."""
    out = {}
    for name, tensor in sd.items():
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[name] = tensor
        elif ".mlp.experts." in name:
            prefix, proj = name.rsplit(".", 1)
            for i, expert in enumerate(tensor.unbind(0)):
                out[f"model.{prefix}.{i}.{proj}.weight"] = expert
        else:
            out[f"model.{name}"] = tensor
    return out


def from_hf_state_dict(hf_sd: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """HF names (per-expert as on disk, or transformers 5's fused in-memory experts) -> our state dict."""
    out, experts = {}, {}
    for hf_name, tensor in hf_sd.items():
        name = hf_name.removeprefix("model.")
        expert = _EXPERT.match(name)
        if expert:
            prefix, index, proj = expert.groups()
            experts.setdefault(f"{prefix}.{proj}", {})[int(index)] = tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            prefix = name.removesuffix(".gate_up_proj")
            out[f"{prefix}.gate_proj"], out[f"{prefix}.up_proj"] = gate, up
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            out[name] = tensor
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[i] for i in range(len(per_expert))])
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def hf_config_dict(cfg) -> dict:
    """Keyword arguments for transformers' Qwen3Config (dense) or Qwen3MoeConfig (num_experts > 0)."""
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,  # transformers < 5 reads this one, 5.x folds it into rope_parameters
        rope_parameters={"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
    )
    if cfg.num_experts > 0:
        kwargs.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
    return kwargs


def hf_config(cfg):
    """A transformers Qwen3Config / Qwen3MoeConfig equal to our model config."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    return (Qwen3MoeConfig if cfg.num_experts > 0 else Qwen3Config)(**hf_config_dict(cfg))


def model_config_from_hf(config: dict) -> dict:
    """ModelConfig fields from an HF config.json dict (Qwen3 or Qwen3-MoE, transformers 4 or 5 spelling)."""
    model_type = config.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise UserError(f"config.json: model_type {model_type!r} is not Qwen3; use a qwen3 or qwen3_moe checkpoint")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        raise UserError("config.json: use_sliding_window / layer_types ask for sliding-window attention, which "
                        "SpeedLLM's Qwen3 does not implement; use a checkpoint with full attention (Qwen3's default)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    out = dict(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        max_position_embeddings=config.get("max_position_embeddings", 32768),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling_from_hf(config),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        initializer_range=config.get("initializer_range", 0.02),
    )
    if model_type == "qwen3_moe":
        out.update(
            num_experts=config.get("num_experts", config.get("num_local_experts")),
            num_experts_per_tok=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            norm_topk_prob=config.get("norm_topk_prob", False),
            decoder_sparse_step=config.get("decoder_sparse_step", 1),
            mlp_only_layers=list(config.get("mlp_only_layers", [])),
            router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
        )
    return out
