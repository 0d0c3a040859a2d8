"""ModelConfig: the Qwen3 family's architectures as data (the `model=` config group's schema), beside the model it
builds: Qwen3 and Qwen3-MoE, and the hybrid Qwen3.5 / Qwen3-Next (Gated DeltaNet layers beside gated attention)."""

from dataclasses import dataclass, field
from typing import Any, List

from omegaconf import MISSING

# The linear projections of a layer (attention, Gated DeltaNet — Qwen3.5's split and Qwen3-Next's fused inputs —
# and the dense MLP or shared expert), by the last part of their names: what LoRA adapts and quantization applies
# to (PEFT's target_modules, HF's weight names)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
               "in_proj_qkvz", "in_proj_ba", "out_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelConfig:
    """Qwen3 architecture; field names follow transformers' Qwen3Config / Qwen3MoeConfig, and for the hybrid family
    Qwen3_5TextConfig / Qwen3_5MoeTextConfig / Qwen3NextConfig (each layer's mixer by `layer_types`)."""

    name: str = MISSING
    vocab_size: int = MISSING
    hidden_size: int = MISSING
    intermediate_size: int = MISSING
    num_hidden_layers: int = MISSING
    num_attention_heads: int = MISSING
    num_key_value_heads: int = MISSING
    head_dim: int = 128
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    # RoPE scaling as transformers' rope_parameters without rope_theta, e.g. {rope_type: yarn, factor: 4.0,
    # original_max_position_embeddings: 32768}; rope_type: linear | dynamic | yarn. None: plain RoPE.
    rope_scaling: Any = None  # a dict (typed as Any so conf/model/hf.yaml can interpolate it)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # MoE (num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    # MoE plus a shared expert gated by sigmoid(Linear(hidden -> 1)) (Qwen3.5-MoE, Qwen3-Next); 0: none
    shared_expert_intermediate_size: int = 0
    # Hybrid family. layer_types: each layer's mixer, "full_attention" (softmax) or "linear_attention" (Gated
    # DeltaNet); empty: every layer full attention (Qwen3).
    layer_types: List[str] = field(default_factory=list)
    # the style of Qwen3.5 / Qwen3-Next: q_proj doubled to carry a sigmoid gate on the attention output per
    # head, and RMSNorm scaling by (1 + weight) with weights initialized at zero
    attention_output_gate: bool = False
    zero_centered_norm: bool = False
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims of each head
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Gated DeltaNet input projections: Qwen3-Next's in_proj_qkvz / in_proj_ba (rows grouped by key head) when
    # true, Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a when false
    linear_fused_projections: bool = False
    # default tokenizer directory for this model (data.tokenizer defaults to it)
    tokenizer: str = "${asset:tokenizers/qwen3}"
