"""Map between our state-dict names and transformers' for the Qwen3 family, and between configs.

Ours: `embed_tokens.weight`, `layers.N.…`, `norm.weight`, `lm_head.weight`, stacked experts
`layers.N.mlp.experts.{gate,up,down}_proj` [E, out, in]. HF: the same under the text model's prefix (`model.`,
or `model.language_model.` in a Qwen3.5 `…ForConditionalGeneration` release directory), `lm_head` at the top;
experts one Linear each on disk (`mlp.experts.{i}.{gate,up,down}_proj.weight`, what save_pretrained writes), or
fused as transformers 5 holds them in memory (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj`
[E, D, I]), which a directory may also store. Tied embeddings have no `lm_head.weight` in an HF checkpoint.
Names outside the text model (`model.visual.*`, `mtp.*`: a release's vision tower and multi-token-prediction
head) are not ours; speedllm.checkpoint.hf carries them from the source directory to an export.

One family per transformers model type, told apart by the config's parts (`hf_model_type`): Qwen3 and
Qwen3-MoE; Qwen3.5 (gated attention, zero-centred norms, Gated DeltaNet with in_proj_qkv / z / b / a) dense and
MoE with a shared expert; Qwen3-Next (the same with the fused in_proj_qkvz / in_proj_ba and Qwen3-MoE's sparsity
keys). Module names equal transformers', so every family's map is this one rename, but for the order of Gated
DeltaNet's q, k, v channels (in_proj_qkv's rows, conv1d's channels): grouped by key head in ours, so that a
tensor-parallel rank's heads are one block of rows; HF's are all q, then all k, then all v (`qkv_channels`).
"""

import re
from dataclasses import dataclass
from typing import Dict

import torch

from speedllm.errors import UserError
from speedllm.models.rope import rope_scaling_from_hf

# our tensors whose rows are Gated DeltaNet's q, k, v channels (a LoRA B on in_proj_qkv has its rows too)
_QKV_ROWS = re.compile(r"linear_attn\.(in_proj_qkv\.(lora_B\.)?weight|conv1d\.weight)$")
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
EXTRA_PREFIXES = ("model.visual.", "mtp.")  # tensors of a release directory that are not the text model
# HF architecture of each model type; a Qwen3.5 release is the ConditionalGeneration of its text model
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
RELEASES = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
HYBRID_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


@dataclass(frozen=True)
class HFNames:
    """How a directory names the text model: its prefix, and whether experts are stored fused."""

    prefix: str = "model."
    fused_experts: bool = False


def hf_names_of(hf_names) -> HFNames:
    """The HFNames of a directory (or state dict) holding tensors `hf_names`."""
    names = list(hf_names)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."
    return HFNames(prefix, any(n.endswith(".mlp.experts.gate_up_proj") for n in names))


def is_extra(hf_name: str) -> bool:
    return hf_name.startswith(EXTRA_PREFIXES)


def hf_model_type(cfg) -> str:
    """transformers' model type of the text model `cfg` describes."""
    if cfg.attention_output_gate:
        if cfg.linear_fused_projections:
            return "qwen3_next"
        return "qwen3_5_moe_text" if cfg.num_experts > 0 else "qwen3_5_text"
    return "qwen3_moe" if cfg.num_experts > 0 else "qwen3"


def qkv_channels(cfg) -> torch.Tensor:
    """HF's channel for each of our Gated DeltaNet q, k, v channels: ours are grouped by key head ([q, k, v of its
    value heads] per key head), HF's are all q, all k, then all v."""
    heads, k_dim = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    group_v = cfg.linear_num_value_heads // heads * cfg.linear_value_head_dim
    q = torch.arange(heads)[:, None] * k_dim + torch.arange(k_dim)
    v = 2 * heads * k_dim + torch.arange(heads)[:, None] * group_v + torch.arange(group_v)
    return torch.cat([q, q + heads * k_dim, v], dim=1).reshape(-1)


def has_qkv_rows(name: str) -> bool:
    """Whether our tensor `name`'s rows are Gated DeltaNet's q, k, v channels (in our order)."""
    return _QKV_ROWS.search(name) is not None


def hf_rows(name: str, tensor: torch.Tensor, cfg, to_hf: bool = True) -> torch.Tensor:
    """`tensor` (our `name`) with its rows in HF's order (to_hf) or back in ours; others unchanged."""
    if not has_qkv_rows(name):
        return tensor
    channels = qkv_channels(cfg)
    return tensor[torch.argsort(channels)] if to_hf else tensor[channels]


def to_hf_state_dict(sd: Dict[str, torch.Tensor], cfg, names: HFNames = HFNames()) -> Dict[str, torch.Tensor]:
    """Our state dict -> HF checkpoint names (experts as `names` stores them, no lm_head when tied). With fused
    experts a layer's gate_proj and up_proj must come together (they make one gate_up_proj)."""
    out = {}
    for name, tensor in sd.items():
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[name] = tensor
        elif ".mlp.experts." in name and names.fused_experts:
            prefix, proj = name.rsplit(".", 1)
            if proj == "down_proj":
                out[f"{names.prefix}{name}"] = tensor
            elif proj == "gate_proj":
                out[f"{names.prefix}{prefix}.gate_up_proj"] = torch.cat([tensor, sd[f"{prefix}.up_proj"]], dim=1)
        elif ".mlp.experts." in name:
            prefix, proj = name.rsplit(".", 1)
            for i, expert in enumerate(tensor.unbind(0)):
                out[f"{names.prefix}{prefix}.{i}.{proj}.weight"] = expert
        else:
            out[f"{names.prefix}{name}"] = hf_rows(name, tensor, cfg)
    return out


def from_hf_state_dict(hf_sd: Dict[str, torch.Tensor], cfg) -> Dict[str, torch.Tensor]:
    """HF names (per-expert as on disk, or fused experts; either prefix) -> our state dict; extras left out."""
    prefix = hf_names_of(hf_sd).prefix
    out, experts = {}, {}
    for hf_name, tensor in hf_sd.items():
        if is_extra(hf_name):
            continue
        name = hf_name.removeprefix(prefix)
        expert = _EXPERT.match(name)
        if expert:
            layer, index, proj = expert.groups()
            experts.setdefault(f"{layer}.{proj}", {})[int(index)] = tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            layer = name.removesuffix(".gate_up_proj")
            out[f"{layer}.gate_proj"], out[f"{layer}.up_proj"] = gate, up
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            out[name] = hf_rows(name, tensor, cfg, to_hf=False)
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[i] for i in range(len(per_expert))])
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def hf_config_dict(cfg) -> dict:
    """Keyword arguments for the transformers config of `hf_model_type(cfg)` (Qwen3Config, Qwen3MoeConfig,
    Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig)."""
    model_type = hf_model_type(cfg)
    rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
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
        rope_parameters=rope,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
    )
    if model_type in HYBRID_TYPES:
        for key in ("rope_theta", "use_sliding_window"):
            del kwargs[key]
        rope["partial_rotary_factor"] = cfg.partial_rotary_factor
        kwargs.update(layer_types=list(cfg.layer_types), linear_num_key_heads=cfg.linear_num_key_heads,
                      linear_num_value_heads=cfg.linear_num_value_heads,
                      linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
                      linear_conv_kernel_dim=cfg.linear_conv_kernel_dim)
    if model_type == "qwen3_5_moe_text":
        del kwargs["intermediate_size"]
    if cfg.num_experts > 0:
        kwargs.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
        if model_type != "qwen3_5_moe_text":  # Qwen3.5-MoE: every layer sparse, top-k always renormalized
            kwargs.update(norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
                          mlp_only_layers=list(cfg.mlp_only_layers))
        if cfg.shared_expert_intermediate_size:
            kwargs["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    return kwargs


def hf_config(cfg):
    """A transformers config equal to our model config (architectures set)."""
    import transformers

    classes = {"qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "qwen3_next": "Qwen3NextConfig",
               "qwen3_5_text": "Qwen3_5TextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig"}
    model_type = hf_model_type(cfg)
    config = getattr(transformers, classes[model_type])(**hf_config_dict(cfg))
    config.architectures = [ARCHITECTURES[model_type]]
    return config


def text_config(config: dict) -> dict:
    """The text model's part of an HF config.json: its text_config in a Qwen3.5 release (tie_word_embeddings from
    the top when the text part leaves it out), else the whole."""
    if "text_config" not in config:
        return config
    return {"tie_word_embeddings": config.get("tie_word_embeddings", False), **config["text_config"]}


def model_config_from_hf(config: dict) -> dict:
    """ModelConfig fields from an HF config.json dict (any family above, transformers 4 or 5 spelling)."""
    config = text_config(config)
    model_type = config.get("model_type")
    model_type = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(model_type, model_type)
    if model_type not in ARCHITECTURES:
        raise UserError(f"config.json: model_type {model_type!r} is not in the Qwen3 family; use one of "
                        f"{', '.join(ARCHITECTURES)} (or a Qwen3.5 release: qwen3_5, qwen3_5_moe)")
    if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
        raise UserError("config.json: use_sliding_window / layer_types ask for sliding-window attention, which "
                        "SpeedLLM's Qwen3 does not implement; use a checkpoint with full attention (Qwen3's default)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    out = dict(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config.get("intermediate_size", 0),  # Qwen3.5-MoE has no dense MLP
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
    if model_type in HYBRID_TYPES:
        interval = config.get("full_attention_interval", 4)
        out.update(
            layer_types=list(config.get("layer_types") or [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(config["num_hidden_layers"])]),
            attention_output_gate=True,
            zero_centered_norm=True,
            partial_rotary_factor=float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))),
            linear_num_key_heads=config.get("linear_num_key_heads", 16),
            linear_num_value_heads=config.get("linear_num_value_heads", 32),
            linear_key_head_dim=config.get("linear_key_head_dim", 128),
            linear_value_head_dim=config.get("linear_value_head_dim", 128),
            linear_conv_kernel_dim=config.get("linear_conv_kernel_dim", 4),
            linear_fused_projections=model_type == "qwen3_next",
        )
    if model_type in ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        sparse_keys = model_type != "qwen3_5_moe_text"
        out.update(
            num_experts=config.get("num_experts", config.get("num_local_experts")),
            num_experts_per_tok=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            norm_topk_prob=config.get("norm_topk_prob", model_type != "qwen3_moe") if sparse_keys else True,
            decoder_sparse_step=config.get("decoder_sparse_step", 1) if sparse_keys else 1,
            mlp_only_layers=list(config.get("mlp_only_layers") or []) if sparse_keys else [],
            router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
            shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0),
        )
    return out
