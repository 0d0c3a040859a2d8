"""Activations per rank of a training step, what a pipeline keeps in flight, the loss, and the rank's
total (see speedllm.planner.memory).
"""

import math
from dataclasses import dataclass
from typing import Tuple

from speedllm.hardware import DTYPES
from speedllm.models.flops import GDN_CHUNK
from speedllm.ops.loss import chunk_rows
from speedllm.parallel.rules import ulysses_degree
from speedllm.planner.layout import Layout
from speedllm.planner.tensors import MASTER_BYTES, UPDATE_TEMPORARIES
from speedllm.planner.training import StageParams, fsdp_degrees, placed_state_bytes
from speedllm.train.optimizer import fused_adamw


@dataclass
class Memory:
    """Bytes per device of one pipeline rank, by component, and the peak over a step's two phases; what
    parallel.offload and train.activation_offload move to host memory is in `host` instead.

    Forward/backward holds the weights, optimizer states, activations and buffers, plus gradients only while
    they accumulate over micro-batches (the loop frees a step's gradients after the update); the optimizer
    update holds weights, gradients, states and the update's temporaries.
    """

    params: float = 0.0
    grads: float = 0.0  # this rank's (sharded) gradients, alive from the end of backward to the update
    grad_accum: float = 0.0  # gradients accumulating over micro-batches, alive through forward and backward
    optimizer: float = 0.0
    activations: float = 0.0
    # activations alive once gradients exist (a pipeline rank has run one backward by then)
    activations_with_grads: float = 0.0
    buffers: float = 0.0  # FSDP2 all-gathered weights, autocast weight copies, pipeline send/receive
    update_temporaries: float = 0.0
    pp_rank: int = 0
    # host memory of this rank (parallel.offload, train.activation_offload): not part of the device peak
    host: float = 0.0
    host_activations: float = 0.0  # of `host`: saved activations at their peak
    offloaded_per_layer: float = 0.0  # activation bytes one layer sends to the host per micro-batch
    teacher: float = 0.0  # a frozen model's weights on this rank (teacher_bytes): distill's teacher, grpo's reference
    rollout: float = 0.0  # task=grpo: the sampling KV cache of this rank's completions (rollout_cache_bytes)
    logits: float = 0.0  # unchunked output logits a task's forward holds beside the activations (task=grpo's update)

    @property
    def task(self) -> float:
        """What the task adds (its SPEC's memory): a frozen model, a rollout cache, unchunked logits."""
        return self.teacher + self.rollout + self.logits

    @property
    def sampling(self) -> float:
        """task=grpo's rollout, before the step's forward: no activations and no gradients yet."""
        return self.params + self.optimizer + self.teacher + self.rollout

    @property
    def forward_backward(self) -> float:
        live = max(self.activations, self.grad_accum + self.activations_with_grads)
        return self.params + self.optimizer + self.buffers + live + self.teacher + self.logits

    @property
    def update(self) -> float:
        return self.params + self.grads + self.optimizer + self.update_temporaries + self.teacher

    @property
    def total(self) -> float:
        return max(self.forward_backward, self.update, self.sampling)


def saved_bytes_per_element(ops: str, e: int) -> Tuple[int, int, int]:
    """Bytes an op set keeps for backward per element of (an RMSNorm's input, a RoPE input, the MLP width).

    reference: RMSNorm keeps an fp32 copy of its input and its normalized output; RoPE multiplies by constant
    tables and keeps nothing; SwiGLU keeps gate, up, silu(gate) and the product. cuda: torch's fused rms_norm
    keeps its input, the rest is eager. npu: npu_rms_norm and npu_rotary_mul keep their input, npu_swiglu the
    concatenated gate/up and its output. cpu: the fused RMSNorm keeps its input (and 4 bytes a row), RoPE nothing,
    SwiGLU gate and up (the product is kept by down_proj).
    """
    if ops == "npu":
        return e, e, 3 * e
    if ops == "cpu":
        return e, 0, 3 * e
    if ops == "cuda":
        return e, 0, 4 * e
    return 4 + e, 0, 4 * e


def gdn_activation_bytes(m, e: int, norm_b: int, ops: str = "reference", tp: int = 1) -> float:
    """Bytes a Gated DeltaNet mixer saves per token for backward without recompute (speedllm.models.gated_deltanet),
    beyond its input: the conv's padded input, pre-SiLU output and SiLU output (the rule's q, k, v); z in fp32
    (the gate's input), a + dt_bias and its softplus, the decay and beta; the rule's own, by op set; the gated
    norm's (its RMSNorm's, its output, silu(z) in fp32) and out_proj's input. Under tensor parallelism a rank holds
    1/tp of the heads.

    The rule: cpu (speedllm.ops.gated_delta_cpu) keeps its inputs and the fp32 state at each chunk's start; cuda
    (flash-linear-attention) the L2-normalized q and k and their fp32 inverse norms, the fp32 cumulative decay and
    the UT transform's chunk-wide matrix A; the reference twin (npu, and cuda without fla) autograd's intermediates
    of speedllm.ops.gated_delta in fp32: six chunk-wide score matrices, about nine key-wide and two value-wide
    tensors per value head, the state at each chunk, and fp32 copies of low-precision q and k.
    (tests/test_hybrid_plan.py holds these against the tensors autograd saves.)
    """
    hk, hv, k, v = m.linear_num_key_heads / tp, m.linear_num_value_heads / tp, m.linear_key_head_dim, \
        m.linear_value_head_dim
    c, vd = 2 * hk * k + hv * v, hv * v
    conv = 3 * e * c
    gates = 4 * vd + 3 * 4 * hv + e * hv
    if ops == "cpu":
        rule = 4 * hv * k * v / GDN_CHUNK
    elif ops == "cuda":
        rule = 2 * e * hk * k + 2 * 4 * hk + 4 * hv + e * GDN_CHUNK * hv
    else:
        rule = 4 * hv * (6 * GDN_CHUNK + 9 * k + 2 * v + k * v / GDN_CHUNK) + (2 * 4 * hk * k if e < 4 else 0)
    norm = norm_b * vd + (2 * e + 4) * vd
    return conv + gates + rule + norm


def gdn_matmul_bytes(m, e: int, ops: str = "reference", tp: int = 1) -> float:
    """Bytes per token of a Gated DeltaNet mixer's matmul outputs, which selective recompute keeps
    (speedllm.parallel.parallelize's policy): the input projections and, by op set, the rule's fp32 matmuls (cpu:
    q k^T and k k^T per key head, the UT transform's u and w, the intra-chunk output and the state updates; the
    reference twin: its two chunk-wide score products, three value-wide products and the state updates; fla's
    kernels are not aten matmuls). out_proj's output is the layer's (layer_activation_bytes)."""
    hk, hv, k, v = m.linear_num_key_heads / tp, m.linear_num_value_heads / tp, m.linear_key_head_dim, \
        m.linear_value_head_dim
    projections = e * (2 * hk * k + 2 * hv * v + 2 * hv)
    if ops == "cpu":
        rule = 4 * (2 * hk * GDN_CHUNK + hv * (2 * v + k) + hv * k * v / GDN_CHUNK)
    elif ops == "cuda":
        rule = 0.0
    else:
        rule = 4 * hv * (2 * GDN_CHUNK + 3 * v + k * v / GDN_CHUNK)
    return projections + rule


def layer_activation_bytes(m, layout: Layout, seq_len: int, dtype_bytes: int, moe: bool, tp_dims,
                           ops: str = "reference", linear: bool = False) -> float:
    """Bytes one decoder layer saves for backward for one micro-batch, by recompute policy.

    Args:
        tp_dims: whether the TP plan splits (the MLP width, the experts' width, the vocabulary).
        ops: the hardware profile's op set (what the fused kernels keep differs, see saved_bytes_per_element).
        linear: a Gated DeltaNet mixer instead of attention (its heads split over tp like attention's).
    """
    e, tp = dtype_bytes, layout.tp
    sp = tp if layout.sequence_parallel else 1
    n = layout.micro_batch * seq_len / layout.cp
    h, d = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d / tp, m.num_key_value_heads * d / tp
    lse = 4 * m.num_attention_heads / tp  # attention's fp32 log-sum-exp per query head
    k_top = m.num_experts_per_tok
    i_moe = m.moe_intermediate_size / (tp if tp_dims[1] else 1)
    i_mlp = m.intermediate_size / (tp if tp_dims[0] else 1)
    if layout.recompute == "full":
        return n * h * e / sp  # the layer input; the rest is rebuilt in backward
    gate = m.attention_output_gate  # q_proj also yields a gate per query: sigmoid(gate) * attention's output
    if layout.recompute == "selective":
        # the layer input and the outputs of matmuls and attention (see speedllm/parallel/parallelize.py)
        attn = e * h / sp + e * (q * (2 if gate else 1) + 2 * kv) + e * q + lse + e * h / sp
        if linear:  # the input, out_proj's output and the mixer's other matmul outputs
            attn = e * h / sp + gdn_matmul_bytes(m, e, ops, tp) + e * h / sp
        # a MoE block under sequence parallel routes only this rank's share of the tokens
        mlp = e * (m.num_experts + k_top * (2 * i_moe + h)) / sp if moe else e * (2 * i_mlp + h / sp)
        return n * (attn + mlp)
    norm_b, rope_b, swiglu_b = saved_bytes_per_element(ops, e)
    # two RMSNorms on the (sequence-parallel) residual stream; the all-gathered input of the projections
    # after each is saved at full size by those projections (a MoE block takes its local tokens ungathered)
    norms = 2 * norm_b * h / sp + e * h + e * h / (sp if moe else 1)
    # q and k: the projection and normed heads (kept by their RMSNorm), RoPE's input, the rotated heads (kept
    # by attention); v; attention's output and the contiguous copy fed to o_proj
    attn = (norm_b + rope_b) * (q + kv) + e * q + attention_keys_bytes(m, layout, e) + 2 * e * q + lse
    if gate:  # the gate, its sigmoid and the product's other input
        attn += 3 * e * q
    if linear:  # instead of attention
        attn = gdn_activation_bytes(m, e, norm_b, ops, tp)
    if moe:
        router = 4 * m.num_experts  # fp32 router probabilities
        # rows sorted by expert, expert outputs; of this rank's share of the tokens under sequence parallel
        mlp = (router + 2 * e * k_top * h + swiglu_b * k_top * i_moe) / sp
    else:
        mlp = swiglu_b * i_mlp
    return n * (norms + attn + mlp)


def attention_keys_bytes(m, layout: Layout, e: int) -> float:
    """Bytes per local token that attention keeps of keys and values (and, for ring attention, of each K/V
    block's partial result), by parallel.cp_mode (speedllm/parallel/context.py).

    allgather keeps the gathered K/V of the whole sequence; ulysses the K/V of all positions for its share
    of the heads (kv heads repeated up to a multiple of cp); ring keeps every block it received and per block
    the fp32 partial output, log-sum-exp and merge weight (the block's scores are recomputed in backward).
    """
    cp, tp = layout.cp, layout.tp
    kv = m.num_key_value_heads * m.head_dim / tp
    if cp == 1:
        return 2 * e * kv
    heads = m.num_attention_heads // tp
    n = ulysses_degree(layout.cp_mode, cp, 0, heads)
    kv_heads = m.num_key_value_heads // tp
    kv *= n // math.gcd(kv_heads, n)  # repeated so the all-to-all splits them
    if layout.cp_mode == "allgather":
        return 2 * e * kv * cp
    if layout.cp_mode == "ulysses":
        return 2 * e * kv
    ring = cp // n
    return ring * (2 * e * kv + 4 * (m.num_attention_heads * m.head_dim / tp + 2 * heads))


def ring_backward_bytes(m, layout: Layout, seq_len: int) -> float:
    """Backward's temporaries of one recomputed ring-attention chunk: fp32 scores, their masked copy,
    probabilities and the gradients of the two (about five [queries x block keys] fp32 matrices per head)."""
    from speedllm.parallel.context import RING_QUERY_CHUNK

    if layout.cp == 1 or layout.cp_mode not in ("ring", "hybrid"):
        return 0.0
    n = ulysses_degree(layout.cp_mode, layout.cp, 0, m.num_attention_heads // layout.tp)
    block = layout.micro_batch * seq_len / (layout.cp // n)  # keys of one ring block (all its heads' share)
    heads = m.num_attention_heads / layout.tp / n
    return 5 * 4 * heads * min(RING_QUERY_CHUNK, block) * block


def in_flight(layout: Layout, pp_rank: int, num_micro: int) -> int:
    """Stage-micro-batches whose activations rank `pp_rank` holds at once under the pipeline schedule."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "GPipe":
        return num_micro * layout.vpp
    warmup = (layout.vpp - 1) * layout.pp + 2 * (layout.pp - 1 - pp_rank) if layout.vpp > 1 \
        else layout.pp - 1 - pp_rank
    return min(warmup + 1, num_micro * layout.vpp)


def loss_bytes(m, layout: Layout, seq_len: int, dtype_bytes: int, chunk: int, vocab_split: int) -> Tuple[float, float]:
    """(saved, transient) bytes of the last stage's norm + chunked output projection and loss for one micro-batch.

    The chunked loss keeps the hidden-state gradient and the weight gradient (fp32 while accumulating) from its
    forward; a chunk's logits live only inside it (logits, fp32 copy, softmax work, their gradient).
    """
    e = dtype_bytes
    n = layout.micro_batch * seq_len / layout.cp
    v = m.vocab_size / vocab_split
    saved = n * m.hidden_size * (4 + 2 * e) + v * m.hidden_size * e
    # a chunk's logits and their gradient (fp32 beside low-precision logits), and the fp32 weight-gradient
    # accumulator when the weight is in low precision
    transient = chunk_rows(chunk, n, v) * v * (4 if e == 4 else 4 + e)
    if e < 4:
        transient += v * m.hidden_size * 4
    return saved, transient


def rank_memory(m, layout: Layout, sp: StageParams, pp_rank: int, seq_len: int,
                global_batch: int, dtype: str, loss_chunk: int, tp_dims, ops: str = "reference",
                device: str = "cuda", muon_bytes: int = 0) -> Memory:
    """Peak bytes of pipeline rank `pp_rank` in a training step.

    Args:
        tp_dims: whether the TP plan splits (the MLP width, the experts' width, the vocabulary), see tp_facts.
        device: the profile's device type, which decides whether AdamW runs fused (speedllm.train.optimizer).
        muon_bytes: optim=muon's Newton-Schulz dtype size (0: another optimizer); its update holds the largest
            gathered matrix, its working copy and the orthogonalized result in that dtype.
    """
    e = DTYPES[dtype].itemsize
    num_micro = global_batch // (layout.micro_batch * layout.dp)
    mem = Memory(pp_rank=pp_rank)
    (mem.params, mem.grads, mem.optimizer), host = placed_state_bytes(sp, layout.offload)
    mem.host = sum(host)
    if layout.offload == "params":  # the update runs on the host (fused AdamW on a CPU: no temporaries)
        mem.update_temporaries = 0.0
    elif layout.offload == "optimizer":  # one parameter's states at a time on the device
        mem.update_temporaries = sp.max_tensor_state * MASTER_BYTES
    else:
        mem.update_temporaries = 0.0 if fused_adamw(device) else sp.sharded * MASTER_BYTES * UPDATE_TEMPORARIES
    mem.update_temporaries += 3 * sp.muon_largest * muon_bytes
    accumulating = num_micro > 1 or layout.pp > 1
    dense_fsdp, _ = fsdp_degrees(layout)
    if layout.fsdp and (dense_fsdp > 1 or layout.offload != "none"):  # offload: FSDP2 on a 1-rank mesh too
        # torch's pipeline schedules keep a stage's weights gathered until its last backward; otherwise FSDP2
        # holds the root unit (embedding, final norm, lm_head) and about one layer gathered at a time
        if layout.pp > 1 or not layout.reshard_after_forward:
            mem.buffers = sp.gathered * e
        else:
            mem.buffers = (sp.root_gathered + sp.max_layer_gathered) * e
        if accumulating:  # without a gradient sync FSDP2 accumulates unsharded, in fp32 (the reduce dtype)
            mem.grad_accum = sp.gathered * MASTER_BYTES
        if layout.offload == "params":  # a unit's fp32 shards are copied to the device before its all-gather
            mem.buffers += sp.max_layer_sharded * MASTER_BYTES
    else:
        if e < MASTER_BYTES:
            mem.buffers = sp.gathered * e  # autocast keeps a low-precision copy of every weight during forward
        if accumulating:
            mem.grad_accum = mem.grads
    flight = in_flight(layout, pp_rank, num_micro)
    max_stage_layers = max(sp.per_stage_layers)
    full = Layout(**{**layout.__dict__, "recompute": "none"})
    act = {(linear, moe): layer_activation_bytes(m, layout, seq_len, e, moe, tp_dims, ops, linear)
           for linear, moe in sp.layer_mix}
    act_full = {(linear, moe): layer_activation_bytes(m, full, seq_len, e, moe, tp_dims, ops, linear)
                for linear, moe in sp.layer_mix}
    # the costliest of this rank's stages, each layer by its own kind (a stage's micro-batch holds all its layers)
    per_stage_act = max(sum(count * act[mix] for mix, count in stage.items()) for stage in sp.stage_mixes)
    # a recomputed layer is rebuilt whole in backward; the loss's chunk logits live only inside its forward
    working = 0.0 if layout.recompute == "none" else max(act_full.values(), default=0.0)
    head = 0.0
    transient = 0.0
    if sp.has_head:
        saved, transient = loss_bytes(m, layout, seq_len, e, loss_chunk, layout.tp if tp_dims[2] else 1)
        # the loss stage runs each micro-batch's backward right after its forward, except under GPipe
        head = saved * (num_micro if layout.pp > 1 and layout.schedule == "GPipe" else 1)
        vocab = m.vocab_size / (layout.tp if tp_dims[2] else 1)
        if working:  # the output projection's gradient is made at the start of backward and kept to the end
            working += vocab * m.hidden_size * MASTER_BYTES
    # ring attention rebuilds one chunk of a block's scores at a time in backward (speedllm.parallel.context)
    transient = max(transient, ring_backward_bytes(m, layout, seq_len))
    flight_with_grads = max(flight - 1, 1) if layout.pp > 1 else flight
    layer_act = per_stage_act / max_stage_layers
    if layout.activation_offload:
        # the decoder layers' saved tensors go to the host (selective recompute: only the layer input, its kept
        # matmul outputs stay in the checkpoint's cache); the device holds the layer being copied out in
        # forward, or the one in use and the one prefetched in backward
        n = layout.micro_batch * seq_len / layout.cp
        moved = n * m.hidden_size * e / (layout.tp if layout.sequence_parallel else 1) \
            if layout.recompute == "selective" else layer_act
        mem.offloaded_per_layer = moved
        mem.host_activations = flight * moved * max_stage_layers
        mem.host += mem.host_activations
        per_stage_act -= moved * max_stage_layers
        in_transit = 2 * moved
    else:
        in_transit = 0.0
    mem.activations = flight * per_stage_act + in_transit + head + max(working, transient)
    # a pipeline rank's gradients appear with its first backward, which frees one micro-batch's activations
    mem.activations_with_grads = flight_with_grads * per_stage_act + in_transit + head + max(working, transient)
    if layout.pp > 1:
        n = layout.micro_batch * seq_len / layout.cp
        mem.buffers += 4 * n * m.hidden_size * e / (layout.tp if layout.sequence_parallel else 1)
    return mem
