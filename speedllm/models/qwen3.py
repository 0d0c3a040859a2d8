"""The Qwen3 family as one readable single-device model (parallelism is applied from outside): Qwen3 dense and
MoE, and the hybrid Qwen3.5 / Qwen3-Next, whose layers each pick their parts from the config: a mixer (softmax
attention, optionally gated with partial rotary, or Gated DeltaNet by `layer_types`) and an MLP (dense, MoE, or
MoE plus a sigmoid-gated shared expert).

Letters: B batch, S sequence (this step), T keys (cache length after this step), D hidden, H query heads,
K kv heads, Dh head_dim, R rotary dims, V vocabulary, N tokens (B*S).

Module names mirror transformers' causal LMs without the "model." prefix, so the HF map is a rename.
A pipeline splitter may set `embed_tokens`, `norm`, `lm_head` to None and delete entries of `layers`:
forward then takes / returns hidden states, and for MoE models also the running load-balancing statistics.
"""

from functools import partial
from typing import Callable

import torch
from torch import nn

from speedllm.models.gated_deltanet import GatedDeltaNet
from speedllm.models.init import log_uniform_block_, normal_block_
from speedllm.models.kv_cache import SlotCache, layer_kinds
from speedllm.models.moe import MLP, MoE, load_balancing_loss, pack_stats, unpack_stats
from speedllm.models.rope import inverse_frequencies
from speedllm.ops import Ops, get_ops
from speedllm.ops.batch_invariant import elementwise
from speedllm.ops.loss import chunked_cross_entropy


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm; zero_centered: the hybrid family's, scaling by (1 + weight), all in fp32 and rounded once
    (transformers' Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float, ops: Ops, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.ops = ops
        self.zero_centered = zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            return self.ops.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)
        return self.ops.rms_norm(x, self.weight, self.eps)


def partial_rotary(rotary, x_BSHD, cos_BSR, sin_BSR):
    """RoPE on the first R dims of each head (cos/sin's width), the rest passed through."""
    R = cos_BSR.shape[-1]
    if R == x_BSHD.shape[-1]:
        return rotary(x_BSHD, cos_BSR, sin_BSR)
    return torch.cat([rotary(x_BSHD[..., :R], cos_BSR, sin_BSR), x_BSHD[..., R:]], dim=-1)


class Attention(nn.Module):
    """GQA attention with per-head RMSNorm on q and k before RoPE, no biases. With cfg.attention_output_gate
    (Qwen3.5, Qwen3-Next) q_proj also yields, per head after its query, a gate: output * sigmoid(gate)."""

    def __init__(self, cfg, layer_id: int, ops: Ops):
        super().__init__()
        self.layer_id = layer_id
        self.ops = ops
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.gated = cfg.attention_output_gate
        dim = cfg.hidden_size
        q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(dim, q_dim * (2 if self.gated else 1), bias=False)
        self.k_proj = nn.Linear(dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, cfg.zero_centered_norm)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops, cfg.zero_centered_norm)

    def forward(self, x_BSD, cos_BSR, sin_BSR, mask, kv_cache=None, attend=None):
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, -1, self.head_dim * (2 if self.gated else 1))
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        q = partial_rotary(self.ops.rotary, self.q_norm(q), cos_BSR, sin_BSR)
        k = partial_rotary(self.ops.rotary, self.k_norm(self.k_proj(x_BSD).view(B, S, -1, self.head_dim)),
                           cos_BSR, sin_BSR)
        v = self.v_proj(x_BSD).view(B, S, -1, self.head_dim)
        if attend is not None:  # packed documents or context parallel: the forward's own attention
            out = attend(q, k, v, self.scale).reshape(B, S, -1)
        else:
            q_BHSD, k_BKTD, v_BKTD = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if kv_cache is not None:
                k_BKTD, v_BKTD = kv_cache.update(self.layer_id, k_BKTD, v_BKTD)
            out = self.ops.attention(q_BHSD, k_BKTD, v_BKTD, mask, self.scale).transpose(1, 2).reshape(B, S, -1)
        if self.gated:
            out = out * elementwise(torch.sigmoid, gate.reshape(B, S, -1))
        return self.o_proj(out)


def masked_attention(attention, mask):
    """`attend` (q_BSHD, k_BSKD, v_BSKD, scale) -> o_BSHD through an op set's attention with a fixed mask."""

    def attend(q_BSHD, k_BSKD, v_BSKD, scale):
        out = attention(q_BSHD.transpose(1, 2), k_BSKD.transpose(1, 2), v_BSKD.transpose(1, 2), mask, scale)
        return out.transpose(1, 2)

    return attend


def document_bounds(document_ids_BS: torch.Tensor):
    """(cu_seqlens int32 [docs + 1], max_seqlen) of the documents of packed rows, rows back to back."""
    B, S = document_ids_BS.shape
    starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    starts = starts_BS.reshape(-1).nonzero().squeeze(1)
    cu_seqlens = torch.cat([starts, starts.new_tensor([B * S])]).to(torch.int32)
    return cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def varlen_attention(varlen, cu_seqlens, max_seqlen):
    """`attend` over packed documents through an op set's varlen attention (no [S, S] mask)."""

    def attend(q_BSHD, k_BSKD, v_BSKD, scale):
        B, S = q_BSHD.shape[:2]
        flat = [x.reshape(B * S, *x.shape[2:]) for x in (q_BSHD, k_BSKD, v_BSKD)]
        return varlen(*flat, cu_seqlens, max_seqlen, scale).view(q_BSHD.shape)

    return attend


def is_moe_layer(cfg, layer_id: int) -> bool:
    """transformers' rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    return (
        cfg.num_experts > 0
        and layer_id not in cfg.mlp_only_layers
        and (layer_id + 1) % cfg.decoder_sparse_step == 0
    )


class DecoderLayer(nn.Module):
    """A mixer (`self_attn`: softmax attention, or `linear_attn`: Gated DeltaNet, by cfg.layer_types) and an MLP
    (dense, or MoE with the shared expert the config may give it), each after its RMSNorm, with residuals."""

    def __init__(self, cfg, layer_id: int, ops: Ops):
        super().__init__()
        zero_centered = cfg.zero_centered_norm
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, zero_centered)
        self.is_linear = layer_kinds(cfg)[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_id, ops)
        else:
            self.self_attn = Attention(cfg, layer_id, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, zero_centered)
        self.is_moe = is_moe_layer(cfg, layer_id)
        self.mlp = MoE(cfg, ops) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size, ops)

    def forward(self, x_BSD, cos_BSR, sin_BSR, mask, kv_cache=None, token_mask=None, attend=None, documents=None,
                linear_mix=None):
        """Returns the new hidden states and the MoE load-balancing statistics (None for a dense layer).
        `documents`: (document_ids, cu_seqlens) of packed rows, for a Gated DeltaNet mixer; `linear_mix`:
        (mixer, its arguments) -> its output, running it in place of a plain call (context parallelism)."""
        h = self.input_layernorm(x_BSD)
        if self.is_linear:
            mix = self.linear_attn if linear_mix is None else partial(linear_mix, self.linear_attn)
            x_BSD = x_BSD + mix(h, kv_cache, token_mask, *(documents or (None, None)))
        else:
            x_BSD = x_BSD + self.self_attn(h, cos_BSR, sin_BSR, mask, kv_cache, attend=attend)
        h = self.post_attention_layernorm(x_BSD)
        if self.is_moe:
            out, stats = self.mlp(h, token_mask)
            return x_BSD + out, stats
        return x_BSD + self.mlp(h), None


def init_block_(out: torch.Tensor, name: str, shape, offset, cfg, seed: int) -> None:
    """Fill `out`, the block at `offset` of parameter `name` (of `shape`, named as in the whole model), with its
    initial values: ones for RMSNorm weights (zeros for zero-centred ones; the gated norm of Gated DeltaNet is
    not), ones for dt_bias, log(Uniform(0.01, 16)) for A_log (as transformers), else Normal(0,
    initializer_range) (speedllm.models.init)."""
    if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
        out.fill_(1.0)
        return
    if name.endswith("norm.weight"):
        out.fill_(0.0 if cfg.zero_centered_norm else 1.0)
        return
    if name.endswith("A_log"):
        log_uniform_block_(out, name, shape, offset, 0.01, 16.0, seed)
        return
    if cfg.tie_word_embeddings and name == "lm_head.weight":  # a pipeline's last stage holds the tied weight
        name = "embed_tokens.weight"
    normal_block_(out, name, shape, offset, cfg.initializer_range, seed)


class Qwen3(nn.Module):
    """Qwen3 causal LM (dense, or MoE when cfg.num_experts > 0).

    Args:
        cfg: fields of speedllm.models.config.ModelConfig (DictConfig or dataclass).
        ops: op set name (reference | cpu | cuda | npu), normally the hardware profile's `ops`.
        output_loss: (hidden_ND, weight_VD, labels_N, chunk_size, ops) -> ce_sum, the output
            projection + summed cross-entropy; a layout may need its own (speedllm.parallel.output_loss_for:
            vocabulary-parallel under tensor parallelism) without touching this file.
        loss_chunk_size: tokens per chunk of that loss (0: one chunk if the logits fit a budget,
            speedllm.ops.loss.chunk_rows).
    """

    def __init__(self, cfg, ops: str = "reference", output_loss: Callable = chunked_cross_entropy,
                 loss_chunk_size: int = 0):
        super().__init__()
        self.cfg = cfg
        self.ops = get_ops(ops)
        self.loss_chunk_size = loss_chunk_size
        self.output_loss = output_loss
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, self.ops) for i in range(cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.ops, cfg.zero_centered_norm)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_embeddings()
        self.has_moe = any(layer.is_moe for layer in self.layers.values())  # of the whole model, kept by stages
        self.has_linear = "linear_attention" in layer_kinds(cfg)
        # RoPE frequencies are a function of the config, not state: computed here on the CPU (as transformers
        # does) and kept out of the state dict and out of meta-device construction; cos/sin are made per forward.
        self.inv_freq, self.rope_scale = inverse_frequencies(cfg)

    def tie_embeddings(self) -> None:
        """Make lm_head use embed_tokens' weight when the config ties them and this model (or pipeline stage)
        holds both; again after anything that gives parameters new tensors (to_empty(), tensor parallelism)."""
        if self.cfg.tie_word_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            if self.lm_head.weight is not self.embed_tokens.weight:
                self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Normal(0, initializer_range) for every matrix (linear, embedding, router, experts, conv), ones for norms
        (init_block_ has the hybrid family's exceptions).

        Each tensor is drawn from generators keyed by (seed, its name), so a sharded model gets the same values
        block by block (speedllm.parallel.weights). Works on a model built on the meta device and moved with
        `to_empty(device=...)`; the global RNG is left alone.
        """
        for name, param in self.named_parameters():
            init_block_(param, name, param.shape, (0,) * param.ndim, self.cfg, seed)

    def rope(self, position_ids_BS: torch.Tensor, dtype: torch.dtype):
        """cos/sin tables [B, S, R] for the given positions, computed exactly as transformers does. (Qwen3.5's
        MRoPE takes three position streams; text gives all three the same positions, and then its interleaving
        of the streams' frequencies is the identity: plain RoPE on the rotary dims.)"""
        inv_freq, scale = self.inv_freq, self.rope_scale
        scaling = self.cfg.rope_scaling
        if scaling and scaling["rope_type"] == "dynamic":
            seq_len = int(position_ids_BS.max()) + 1
            if seq_len > self.cfg.max_position_embeddings:
                inv_freq, scale = inverse_frequencies(self.cfg, seq_len)
        freqs = position_ids_BS[..., None].float() * inv_freq.to(position_ids_BS.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def attention_mask(self, B, S, start, document_ids, attention_mask, kv_cache, device):
        """None for plain causal attention, else a bool [B, 1, S, T] mask (True = may attend).

        Combines causality (queries sit at positions start..start+S-1), documents of a packed sequence and
        left padding (this step's attention_mask, remembered by the cache for later steps).
        """
        if document_ids is None and attention_mask is None:
            if start == 0 or S == 1 and not kv_cache.padded:
                return None  # plain causal: S == T, or one query after keys that are all real tokens
        T = start + S
        q_pos = torch.arange(start, T, device=device)[:, None]
        k_pos = torch.arange(T, device=device)[None, :]
        mask = (k_pos <= q_pos)[None, None]
        if document_ids is not None:
            mask = mask & (document_ids[:, None, :, None] == document_ids[:, None, None, :T])
        key_mask = None
        if kv_cache is not None:
            if attention_mask is not None:
                kv_cache.key_mask[:, start:T] = attention_mask[:, -S:].bool()
                kv_cache.padded = True
            key_mask = kv_cache.key_mask[:, :T]
        elif attention_mask is not None:
            key_mask = attention_mask.bool()
        if key_mask is not None:
            # A padding query would attend to nothing (NaN softmax); letting it see itself keeps it finite,
            # and its output is never used.
            mask = (mask & key_mask[:, None, None, :]) | (k_pos == q_pos)
        return mask.expand(B, 1, S, T)

    def forward(self, tokens, labels=None, position_ids=None, document_ids=None, attention_mask=None, kv_cache=None,
                attend=None, reduce_moe_stats=None, moe_stats=None, output_loss=None, linear_mix=None):
        """Logits [B, S, V]; or with labels (already shifted, IGNORE_INDEX = no loss) the pair (ce_sum, aux_loss).

        Args:
            tokens: [B, S] token ids, or [B, S, D] hidden states when `embed_tokens` is None (pipeline stage).
            labels: [B, S]; ce_sum is the fp32 SUM of token cross-entropies (computed in chunks of
                `loss_chunk_size` tokens), aux_loss the MoE load-balancing loss times router_aux_loss_coef
                (0 for dense), both over the layers in this module.
            position_ids: [B, S] RoPE positions (default: consecutive from the cache position).
            document_ids: [B, S] packed sequences: tokens attend only within their own document.
            attention_mask: [B, S] (or [B, T]) 1 = token, 0 = left padding.
            kv_cache: a KVCache; this step's keys/values are written at its position, which then advances.
                Or a SlotCache (continuous batching), which also gives the positions and the mask.
            attend: (q_BSHD, k_BSKD, v_BSKD, scale) -> o_BSHD replacing every layer's attention (context
                parallelism passes its own; `masked_attention` gives the op set's masked attention). Default:
                the op set's varlen attention for packed documents, else its causal / masked attention.
            linear_mix: (mixer, x_BSD, kv_cache, token_mask, document_ids, cu_seqlens) -> the Gated DeltaNet
                mixer's output, running every such layer in its place (context parallelism passes its own).
            reduce_moe_stats: sums MoE routing statistics over the ranks sharing these sequences (context
                parallelism), so the load-balancing loss is the whole sequences'.
            moe_stats: [3, E] running routing statistics of the MoE layers of the earlier pipeline stages
                (speedllm.models.moe.pack_stats); this module's layers add theirs.
            output_loss: replaces the model's output projection + loss (same arguments) for this call; what it
                returns is returned in place of ce_sum (task=distill: the divergence from a teacher).
        Returns hidden states instead of logits when `lm_head` is None; for a MoE model the pair (hidden
        states, moe_stats after this module's layers), so the stage holding the head computes the loss of all.
        """
        h_BSD = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens
        B, S = h_BSD.shape[:2]
        mask = None
        if isinstance(kv_cache, SlotCache):  # continuous batching: each row continues at its own length
            position_ids, mask = kv_cache.positions(), kv_cache.attention_mask()
        else:
            start = kv_cache.pos if kv_cache is not None else 0
            if position_ids is None:
                position_ids = torch.arange(start, start + S, device=h_BSD.device).expand(B, S)
            if attend is None and document_ids is not None and kv_cache is None and attention_mask is None:
                attend = varlen_attention(self.ops.varlen_attention, *document_bounds(document_ids))
            elif attend is None:
                mask = self.attention_mask(B, S, start, document_ids, attention_mask, kv_cache, h_BSD.device)
        cos_BSR, sin_BSR = self.rope(position_ids, h_BSD.dtype)
        token_mask = attention_mask[:, -S:] if attention_mask is not None else None
        documents = None
        if document_ids is not None and self.has_linear:  # Gated DeltaNet restarts at each document
            documents = (document_ids, document_bounds(document_ids)[0])

        layer_stats = [] if moe_stats is None else [unpack_stats(moe_stats)]
        for layer in self.layers.values():
            h_BSD, stats = layer(h_BSD, cos_BSR, sin_BSR, mask, kv_cache, token_mask, attend, documents, linear_mix)
            if stats is not None:
                layer_stats.append(stats)
                if self.training:  # here, not in the layer, which activation recompute runs twice
                    layer.mlp.record_load(stats)
        if kv_cache is not None:
            kv_cache.advance(S)

        if self.norm is not None:
            h_BSD = self.norm(h_BSD)
        if self.lm_head is None:
            return (h_BSD, pack_stats(layer_stats, self.cfg.num_experts, h_BSD.device)) if self.has_moe else h_BSD
        if labels is None:
            return self.lm_head(h_BSD)
        ce_sum = (output_loss or self.output_loss)(
            h_BSD.reshape(B * S, -1), self.lm_head.weight, labels.reshape(-1), self.loss_chunk_size,
            self.ops,
        )
        aux_loss = torch.zeros((), dtype=torch.float32, device=h_BSD.device)
        if layer_stats:
            aux_loss = load_balancing_loss(layer_stats, self.cfg.num_experts, reduce_moe_stats) * \
                self.cfg.router_aux_loss_coef
        return ce_sum, aux_loss


def num_params(model: nn.Module, activated: bool = False) -> int:
    """Parameter count (tied weights once); with activated=True, experts count as top_k / num_experts of them."""
    total = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            total += param.numel()
        if activated and isinstance(module, MoE):
            expert_params = sum(p.numel() for p in module.experts.parameters())
            total -= expert_params - expert_params * module.top_k // module.num_experts
    # modules() visits a tied weight under both owners; count it once.
    head, embed = model.lm_head, model.embed_tokens
    if head is not None and embed is not None and head.weight is embed.weight:
        total -= head.weight.numel()
    return total
