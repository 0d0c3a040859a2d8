"""Training FLOPs per token, of the whole model and of each decoder layer (its kind's own cost).

FLOPs per trained token (forward + backward = 3x forward, a multiply-add is 2 FLOPs):
    6 * N_matmul  +  6 * L_attention * H * head_dim * S  +  6 * L_gdn * rule_macs
N_matmul counts the weights every token multiplies with: attention q/k/v/o (q doubled when it carries an output
gate), Gated DeltaNet's input and output projections, the MLP (for MoE layers the top-k experts' MLPs, the router
and a shared expert with its gate), and the output projection (tied or not; the embedding lookup is not a
matmul). The attention term is QK^T and AV (2 matmuls of S x head_dim per head, 2 FLOPs per multiply-add, x3 for
training), halved because a causal mask leaves on average S/2 keys per query. A Gated DeltaNet layer's rule costs
the same at every length (gated_delta_rule_macs).
"""

from typing import List

from speedllm.models.kv_cache import layer_kinds
from speedllm.models.qwen3 import is_moe_layer

GDN_CHUNK = 64  # tokens per chunk of the chunked gated delta rule (speedllm.ops), for its FLOP count


def layer_matmul_params(model, kind: str, moe: bool) -> int:
    """Weights each token is multiplied with in one forward pass of a decoder layer of mixer `kind`
    ("full_attention" or "linear_attention") with a MoE MLP or not (activated experts only)."""
    h, d = model.hidden_size, model.head_dim
    if kind == "linear_attention":
        hv, vd = model.linear_num_value_heads, model.linear_num_value_heads * model.linear_value_head_dim
        # in_proj q, k, v, z, b, a (or the fused qkvz, ba) and out_proj
        mixer = h * (2 * model.linear_num_key_heads * model.linear_key_head_dim + 2 * vd + 2 * hv) + vd * h
    else:
        q = model.num_attention_heads * d * (2 if model.attention_output_gate else 1)
        mixer = h * (q + model.num_attention_heads * d + 2 * model.num_key_value_heads * d)
    if moe:
        mlp = model.num_experts_per_tok * 3 * h * model.moe_intermediate_size + h * model.num_experts
        if model.shared_expert_intermediate_size:
            mlp += 3 * h * model.shared_expert_intermediate_size + h
    else:
        mlp = 3 * h * model.intermediate_size
    return mixer + mlp


def matmul_params_per_token(model) -> int:
    """Weights each token is multiplied with in one forward pass (activated experts only)."""
    kinds = layer_kinds(model)
    return model.vocab_size * model.hidden_size + sum(  # + the output projection
        layer_matmul_params(model, kinds[i], is_moe_layer(model, i)) for i in range(model.num_hidden_layers))


def gated_delta_rule_macs(model) -> float:
    """Multiply-adds per token of one Gated DeltaNet layer's chunked rule, per value head: reading and updating
    the K x V state (q and the UT-transformed keys against it, the state's update: 3 K V) and, inside a chunk of
    GDN_CHUNK tokens, scores against the chunk's earlier tokens (q k^T and the UT's k k^T) and their application
    to the values (on average half the chunk: GDN_CHUNK (2 K + V) / 2). Constant in the sequence length."""
    k, v = model.linear_key_head_dim, model.linear_value_head_dim
    return model.linear_num_value_heads * (3 * k * v + GDN_CHUNK * (2 * k + v) / 2)


def layer_flops(model, seq_len: int) -> List[float]:
    """Training FLOPs per token of each decoder layer at sequence length `seq_len`, by its own kind: its
    matmuls, plus causal attention's scores (growing with the length) or the gated delta rule (constant)."""
    costs = []
    for i, kind in enumerate(layer_kinds(model)):
        mixer = gated_delta_rule_macs(model) if kind == "linear_attention" else \
            model.num_attention_heads * model.head_dim * seq_len
        costs.append(6 * (layer_matmul_params(model, kind, is_moe_layer(model, i)) + mixer))
    return costs


def flops_per_token(model, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`, causal attention."""
    return 6 * model.vocab_size * model.hidden_size + sum(layer_flops(model, seq_len))
