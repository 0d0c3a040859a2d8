"""Time of one training step from the hardware profile: compute, communication per parallel axis, pipeline bubble.

Compute is the step's FLOPs (speedllm.models.flops.flops_per_token, plus the re-run forward under full
recompute) over the devices' peak times an efficiency that falls for small matrix multiplications. Collectives
are ring-based: an all-gather or reduce-scatter moves (k-1)/k of the full tensor through each rank's link, an
all-reduce twice that, an all-to-all (k-1)/k of what a rank sends. A group is on the intra-node link when all
its ranks fit on one node (mesh axes, outermost first: pp, dp, cp, tp), else on the inter-node link.
Tensor/context/expert-parallel and pipeline transfers sit on the critical path; FSDP's gathers and gradient
reductions overlap with compute and only their excess shows. Pipeline schedules are costed by their bubble alone,
with no credit for overlapping a forward with a backward: parallel.pp_schedule=DualPipeV runs torch's
ScheduleDualPipeV without an overlap function, so its paired forward and backward run one after the other and it
costs what a two-stage-per-rank interleaved schedule costs.
"""

from dataclasses import dataclass
from functools import lru_cache

from speedllm.hardware import DTYPES
from speedllm.models.flops import flops_per_token
from speedllm.models.kv_cache import layer_kinds
from speedllm.models.qwen3 import is_moe_layer
from speedllm.planner.layout import Layout
from speedllm.planner.memory import MASTER_BYTES, StageParams, config_key, model_of_key

GEMM_HALF = 128  # rows / columns at which a matmul reaches half its best efficiency


@dataclass
class StepTime:
    """Seconds per step by component; `total` is their critical-path sum."""

    compute: float = 0.0
    routing: float = 0.0  # MoE: permuting token rows into expert order and back (memory-bound)
    recompute: float = 0.0
    bubble: float = 0.0
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    pp: float = 0.0
    dp: float = 0.0  # exposed FSDP / data-parallel communication
    optimizer: float = 0.0
    offload: float = 0.0  # exposed host <-> device copies (parallel.offload, train.activation_offload)
    task: float = 0.0  # the task's own work beyond the step (a rollout's decode, a teacher's forward: its SPEC)

    @property
    def total(self) -> float:
        return (self.compute + self.routing + self.recompute + self.bubble + self.tp + self.cp + self.ep + self.pp
                + self.dp + self.optimizer + self.offload + self.task)


def link_bandwidth(hw, span: int) -> float:
    """Bytes/s per rank of a group whose ranks lie within `span` consecutive ranks."""
    gbps = hw.intra_node_bandwidth_gbps if span <= hw.devices_per_node else hw.inter_node_bandwidth_gbps
    return gbps * 1e9


def ring(k: int) -> float:
    """Share of a tensor each rank's link carries in a ring all-gather / reduce-scatter over k ranks."""
    return (k - 1) / k


def gemm_efficiency(layout: Layout, m, seq_len: int, base: float) -> float:
    """Fraction of peak the model's matmuls reach: `base` for large ones, less when the rows (tokens per
    micro-batch on a rank) or the columns (hidden width per tensor-parallel rank) are few."""
    rows = layout.micro_batch * seq_len / layout.cp
    cols = m.hidden_size / layout.tp
    return base * rows / (rows + GEMM_HALF) * cols / (cols + GEMM_HALF)


def expert_gemm_efficiency(layout: Layout, m, seq_len: int, base: float) -> float:
    """The same for the routed experts' grouped matmuls: a rank's experts see the rows the ep group routes to
    them (ep x its tokens x k / E per expert), by their width (moe_intermediate_size, not split by tp)."""
    tokens = layout.micro_batch * seq_len / layout.cp / (layout.tp if layout.sequence_parallel else 1)
    rows = layout.ep * tokens * m.num_experts_per_tok / m.num_experts
    cols = m.moe_intermediate_size
    return base * rows / (rows + GEMM_HALF) * cols / (cols + GEMM_HALF)


def per_token(m, seq_len: int) -> tuple:
    """(training FLOPs per token, MoE layers) of model `m`: computed once per model and sequence length, the
    search asks for them for every layout."""
    return _per_token(config_key(m), seq_len)


@lru_cache(maxsize=64)
def _per_token(key: tuple, seq_len: int) -> tuple:
    m = model_of_key(key)
    return flops_per_token(m, seq_len), sum(is_moe_layer(m, i) for i in range(m.num_hidden_layers))


def step_time(m, layout: Layout, hw, sp: StageParams, seq_len: int, global_batch: int, efficiency: float,
              selective_bytes: float = 0.0, offloaded_per_layer: float = 0.0, muon=None, measured=None,
              imbalance: float = 1.0) -> StepTime:
    """Estimated seconds of one training step.

    Args:
        sp: the parameters of the busiest pipeline rank (FSDP traffic, optimizer).
        selective_bytes: activation bytes per layer and micro-batch that selective recompute rebuilds
            (memory-bound elementwise work).
        muon: optim=muon's (Newton-Schulz dtype, ns_steps), else None: every rank gathers each of its Muon
            matrices' updates in that dtype and runs the iteration on all of them (speedllm.train.muon).
        measured: on a CPU, (one decoder layer, the rest of the model) in seconds of one micro-batch's forward and
            backward, timed on it (speedllm.planner.cpu_time); they replace the FLOP model's compute.
        imbalance: the busiest pipeline rank's decoder-layer FLOPs over an even share (Planner.pipeline_imbalance):
            the pipeline computes at that rank's pace.
    """
    t = StepTime()
    e = DTYPES[hw.dtype].itemsize
    peak = hw.peak_tflops[hw.dtype] * 1e12
    world = layout.world
    tokens = global_batch * seq_len
    num_micro = global_batch // (layout.micro_batch * layout.dp)
    layers = m.num_hidden_layers / layout.pp  # per pipeline rank
    n = layout.micro_batch * seq_len / layout.cp  # tokens of one micro-batch on one rank
    h = m.hidden_size

    rate = peak * gemm_efficiency(layout, m, seq_len, efficiency)
    flops, moe_layers = per_token(m, seq_len)
    expert_rate = peak * expert_gemm_efficiency(layout, m, seq_len, efficiency) if moe_layers else rate
    # training FLOPs per token of the routed experts' matmuls, part of flops_per_token
    expert = 6 * moe_layers * m.num_experts_per_tok * 3 * h * m.moe_intermediate_size
    dense = flops - expert
    t.compute = (dense / rate + expert / expert_rate) * tokens / world
    # memory-bound routing per MoE layer: the k rows of each token permuted into expert order, back, and
    # combined (3 passes, each a read and a write), forward and backward
    t.routing = 3 * 2 * 2 * m.num_experts_per_tok * h * e * moe_layers * tokens / world / (
        hw.memory_bandwidth_gbps * 1e9)
    if layout.recompute == "full":
        head = 6 * m.vocab_size * h
        t.recompute = ((dense - head) / rate + expert / expert_rate) / 3 * tokens / world + t.routing / 3
    elif layout.recompute == "selective":
        t.recompute = 2 * selective_bytes * layers * num_micro / (hw.memory_bandwidth_gbps * 1e9)
    if measured is not None:  # split over tp and cp ranks as the FLOPs are; routing is part of a timed MoE layer
        layer_s, rest_s = measured
        t.compute = num_micro * (layers * layer_s / (layout.tp * layout.cp) + rest_s / layout.tp)
        t.routing = 0.0
        if layout.recompute == "full":  # the forward again: about a third of forward + backward
            t.recompute = num_micro * layers * layer_s / (layout.tp * layout.cp) / 3
    t.compute, t.recompute = t.compute * imbalance, t.recompute * imbalance
    if layout.pp > 1:
        t.bubble = (layout.pp - 1) / (layout.vpp * num_micro) * (t.compute + t.routing + t.recompute)

    refwd = 1.5 if layout.recompute == "full" else 1.0  # a re-run forward repeats the forward's collectives
    if layout.tp > 1:
        # with SP: all-gather before and reduce-scatter after attention and the MLP, forward and backward
        volume = 8 * refwd * ring(layout.tp) * n * h * e
        t.tp = volume * layers * num_micro / link_bandwidth(hw, layout.tp)
    if layout.cp > 1:
        kv = 2 * m.num_key_value_heads * m.head_dim / layout.tp
        volume = 2 * refwd * (layout.cp - 1) * n * kv * e  # gather K/V forward, reduce their gradient backward
        linear = sum(kind == "linear_attention" for kind in layer_kinds(m)) / layout.pp
        # Gated DeltaNet (speedllm.parallel.context): 2cp - 1 broadcasts of the carried fp32 state and the conv's
        # last W - 1 inputs forward, as many all-reduces of their gradient backward; constant in the length
        conv = (2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads
                * m.linear_value_head_dim) * (m.linear_conv_kernel_dim - 1) * e
        state = m.linear_num_value_heads * m.linear_key_head_dim * m.linear_value_head_dim * 4 + conv
        linear_volume = 2 * refwd * (2 * layout.cp - 1) * layout.micro_batch * state / layout.tp
        t.cp = ((layers - linear) * volume + linear * linear_volume) * num_micro / link_bandwidth(
            hw, layout.cp * layout.tp)
    if layout.ep > 1 and m.num_experts > 0:
        # dispatch + combine forward, and their gradients backward, of this rank's tokens (its sequence shard
        # under sequence parallel); an ep group is `ep` consecutive ranks of dp x cp x tp
        routed = n / (layout.tp if layout.sequence_parallel else 1)
        volume = 4 * refwd * ring(layout.ep) * routed * m.num_experts_per_tok * h * e
        t.ep = volume * layers * num_micro / link_bandwidth(hw, layout.ep)
    if layout.pp > 1:
        sp_div = layout.tp if layout.sequence_parallel else 1
        volume = 2 * n * h * e / sp_div * layout.vpp  # activations forward, their gradient backward
        t.pp = volume * num_micro / link_bandwidth(hw, world)

    data = layout.dp * layout.cp  # FSDP shards over dp x cp (speedllm.parallel.fsdp)
    if data > 1:
        bw = link_bandwidth(hw, data * layout.tp)
        if layout.fsdp:
            gathers = 1 if layout.pp > 1 or not layout.reshard_after_forward else 2 * num_micro
            volume = ring(data) * sp.gathered * (gathers * e + MASTER_BYTES)
        else:
            volume = 2 * ring(layout.dp) * sp.gathered * MASTER_BYTES
        t.dp = max(0.0, volume / bw - t.compute)
    # AdamW reads parameter, gradient and two moments and writes three of them back (fp32)
    t.optimizer = sp.sharded * 7 * MASTER_BYTES / (hw.memory_bandwidth_gbps * 1e9)
    t.offload = offload_time(layout, hw, sp, t, num_micro, layers, offloaded_per_layer)
    if layout.offload == "params":  # the update runs on the host, whose memory the node's devices share
        t.optimizer = sp.sharded * 7 * MASTER_BYTES / (hw.host_memory_bandwidth_gbps * 1e9 / hw.devices_per_node)
    if muon is not None:
        ns_dtype, ns_steps = muon
        ns_peak = hw.peak_tflops.get(ns_dtype, hw.peak_tflops[hw.dtype]) * 1e12
        t.optimizer += (sp.muon_gathered * DTYPES[ns_dtype].itemsize / link_bandwidth(hw, world // layout.pp)
                        + ns_steps * sp.muon_flops / (ns_peak * efficiency))
    return t


def offload_time(layout: Layout, hw, sp: StageParams, t: StepTime, num_micro: int, layers: float,
                 offloaded_per_layer: float) -> float:
    """Seconds of host <-> device copies a step waits for, at the profile's host-link bandwidth.

    parallel.offload=params copies each unit's fp32 shards to the device before every all-gather and the reduced
    gradients back, on FSDP2's streams beside compute (only their excess shows); optimizer brings every state to
    the device and back around its update, which waits; activation offload copies a layer's saved tensors out in
    forward and back in backward on a side stream (only their excess shows).
    """
    link = hw.host_link_bandwidth_gbps * 1e9
    overlapped = waited = 0.0
    if layout.offload == "params":
        gathers = 1 if layout.pp > 1 or not layout.reshard_after_forward else 2 * num_micro
        overlapped += sp.sharded * MASTER_BYTES * (gathers + 1)
    elif layout.offload == "optimizer":
        waited += 2 * sp.optimizer_state * MASTER_BYTES
    if layout.activation_offload:
        overlapped += 2 * offloaded_per_layer * layers * num_micro
    return waited / link + max(0.0, overlapped / link - t.compute)



def forward_seconds(m, layout: Layout, hw, tokens: float, seq_len: int, efficiency: float) -> float:
    """One forward of model `m` (no backward) over `tokens` tokens of `seq_len`, split over the layout's ranks: a
    third of the training FLOPs (a frozen teacher's or reference's forward, a rollout's prefill)."""
    rate = hw.peak_tflops[hw.dtype] * 1e12 * gemm_efficiency(layout, m, seq_len, efficiency)
    return per_token(m, seq_len)[0] / 3 * tokens / layout.world / rate


def decode_seconds(layout: Layout, hw, sp: StageParams, steps: int, cache_bytes: float) -> float:
    """`steps` decode steps of one token per row (memory-bound): each reads the rank's weights in the compute dtype
    and its KV cache, and under FSDP2 first all-gathers every layer over the data-parallel ranks."""
    e = DTYPES[hw.dtype].itemsize
    read = (sp.gathered * e + cache_bytes) / (hw.memory_bandwidth_gbps * 1e9)
    gather = 0.0
    if layout.fsdp and layout.dp > 1:
        gather = sp.gathered * e * ring(layout.dp) / link_bandwidth(hw, layout.dp * layout.tp)
    return steps * max(read, gather)
