"""The rules a parallel layout must follow, as pure functions returning one-line messages (empty: it can run).

One home for them: validation raises the first message before any process starts, the planner's search skips
layouts that break one, and the tests assert the messages. Each message names the key(s) and the fix.
"""

import math
from typing import List, Optional, Sequence

INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two stages per pipeline rank, placed in a V (speedllm.parallel.pipeline)
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", *V_SCHEDULES)
# schedules that split a backward into input and weight gradients, which torch cannot run on compiled modules
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
OFFLOAD = ("none", "optimizer", "params")  # parallel.offload


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _set(values: Sequence[int]) -> str:
    return "{" + ", ".join(map(str, values)) + "}"


def ulysses_degree(cp_mode: str, cp: int, cp_ulysses: int, heads: int) -> int:
    """Context-parallel ranks that split the attention heads (all-to-all): cp for ulysses; for hybrid
    parallel.cp_ulysses, or (0) the largest divisor of cp below cp that divides `heads` (per tp rank); else 1."""
    if cp_mode == "ulysses":
        return cp
    if cp_mode != "hybrid":
        return 1
    return cp_ulysses or max(d for d in range(1, cp) if cp % d == 0 and heads % d == 0)


def layout_errors(model, *, tp: int, pp: int, vpp: int, ep: int, cp: int, dp: int, schedule: str,
                  pp_layers: Optional[Sequence[int]] = None, cp_mode: str = "allgather",
                  cp_ulysses: int = 0, sequence_parallel: bool = True) -> List[str]:
    """What keeps `model` (schema ModelConfig fields) from training under these degrees; dp >= 1."""
    m, name = model, model.name
    errors = [f"parallel.{key}={value} must be >= 1"
              for key, value in (("tp", tp), ("pp", pp), ("vpp", vpp), ("ep", ep), ("cp", cp), ("dp", dp))
              if value < 1]
    if errors:
        return errors
    for heads_key in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads"):
        heads = getattr(m, heads_key)
        if heads % tp:
            errors.append(f"parallel.tp={tp} does not divide {heads_key}={heads} of model {name}; "
                          f"use tp in {_set(divisors(math.gcd(m.num_key_value_heads, m.linear_num_key_heads)))}")
    stages = pp * vpp
    if pp_layers is not None:
        if len(pp_layers) != stages or sum(pp_layers) != m.num_hidden_layers or min(pp_layers) < 1:
            errors.append(f"parallel.pp_layers={list(pp_layers)} must list {stages} stage sizes (pp*vpp) of at "
                          f"least 1 that sum to num_hidden_layers={m.num_hidden_layers} of model {name}")
    elif m.num_hidden_layers % stages:
        errors.append(f"model.num_hidden_layers={m.num_hidden_layers} of model {name} cannot be split evenly over "
                      f"parallel.pp={pp} x parallel.vpp={vpp} = {stages} stages; use pp*vpp in "
                      f"{_set(divisors(m.num_hidden_layers))} or list the layers per stage in parallel.pp_layers")
    if vpp > 1 and schedule not in INTERLEAVED:
        errors.append(f"parallel.vpp={vpp} needs an interleaved schedule; set parallel.pp_schedule to one of "
                      f"{', '.join(INTERLEAVED)} (or vpp=1)")
    if schedule in V_SCHEDULES and pp > 1 and vpp != 2:
        errors.append(f"parallel.pp_schedule={schedule} places two stages per rank in a V; set parallel.vpp=2")
    if ep > 1:
        if m.num_experts == 0:
            errors.append(f"parallel.ep={ep} needs a MoE model but {name} is dense; set parallel.ep=1")
        elif m.num_experts % ep:
            errors.append(f"parallel.ep={ep} does not divide num_experts={m.num_experts} of model {name}; "
                          f"use ep in {_set(divisors(m.num_experts))}")
        if (dp * cp * tp) % ep:
            errors.append(f"parallel.ep={ep} must divide parallel.dp x parallel.cp x parallel.tp = {dp * cp * tp} "
                          f"(experts are spread over the data/context/tensor ranks); raise dp or lower ep")
    # combinations speedllm.parallel.parallelize does not build
    if m.num_experts > 0 and tp > 1 and not sequence_parallel:
        errors.append(f"parallel.tp={tp} with MoE model {name} needs sequence parallel (each tp rank routes its own "
                      "tokens); set parallel.sequence_parallel=true")
    if "linear_attention" in m.layer_types and cp > 1 and tp > 1:
        errors.append(f"parallel.cp={cp} with parallel.tp={tp} is not supported for the hybrid model {name} (Gated "
                      "DeltaNet's state passes between cp ranks on whole activations, not tp's shards); use "
                      "parallel.tp=1 with cp, or cp=1 with tp")
    if cp > 1 and pp > 1:
        errors.append(f"parallel.cp={cp} with parallel.pp={pp} is not supported (context parallelism hooks the "
                      "whole model); use parallel.pp=1 with cp, or cp=1 with pp")
    if cp > 1 and cp_mode == "hybrid" and cp_ulysses and (cp % cp_ulysses or cp_ulysses >= cp):
        errors.append(f"parallel.cp_ulysses={cp_ulysses} must be a divisor of parallel.cp={cp} below it; use one "
                      f"of {_set(divisors(cp)[:-1])}, or 0 to pick one")
    elif cp > 1 and tp >= 1 and m.num_attention_heads % tp == 0:
        heads = m.num_attention_heads // tp
        n = ulysses_degree(cp_mode, cp, cp_ulysses, heads)
        if heads % n:
            key = "parallel.cp" if cp_mode == "ulysses" else "parallel.cp_ulysses"
            errors.append(f"parallel.cp_mode={cp_mode}: {key}={n} must divide the attention heads per tp rank "
                          f"({heads} of model {name}); use {key} in {_set(divisors(heads))} or cp_mode=ring")
    return errors


def pipeline_batch_errors(*, pp: int, vpp: int, schedule: str, pp_microbatches: int, global_batch: int,
                          micro_batch: int, dp: int) -> List[str]:
    """What torch.distributed.pipelining would refuse at the first step, for this step's batch.

    A step hands the schedule the dp rank's global_batch / dp sequences, cut into parallel.pp_microbatches
    micro-batches (0: as many as the loop's global_batch / (micro_batch x dp)).
    """
    if pp == 1:
        return []
    rows = global_batch // dp
    n = pp_microbatches or global_batch // (micro_batch * dp)
    stages = pp * vpp
    where = (f"parallel.pp_microbatches={pp_microbatches}" if pp_microbatches else
             f"train.global_batch_size={global_batch} / (train.micro_batch_size={micro_batch} x parallel.dp={dp})")
    if n > rows:
        return [f"{where} asks for {n} micro-batches but a pipeline step has {rows} sequences per dp rank; "
                "lower parallel.pp_microbatches or raise train.global_batch_size"]
    if schedule in ("1F1B", "DualPipeV") and n < stages:
        return [f"parallel.pp_schedule={schedule} over {stages} stages needs at least {stages} micro-batches per "
                f"step, but {where} gives {n}; raise train.global_batch_size to "
                f"{stages * micro_batch * dp}, lower train.micro_batch_size, or set parallel.pp_microbatches="
                f"{stages}" + (" (or use pp_schedule=GPipe)" if schedule == "1F1B" else "")]
    rounds = max(1, n // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and n % rounds:
        return [f"parallel.pp_schedule={schedule} needs the micro-batches per step to be a multiple of "
                f"{rounds} (rounds of parallel.pp={pp}), but {where} gives {n}; use a multiple of parallel.pp"]
    return []


def compile_errors(*, compile_: bool, pp: int, schedule: str) -> List[str]:
    """train.compile under a pipeline schedule torch runs only on uncompiled stages (pytorch/pytorch#161904)."""
    if compile_ and pp > 1 and schedule in SPLIT_BACKWARD:
        return [f"train.compile=true with parallel.pp_schedule={schedule}: torch splits this schedule's backward "
                "into input and weight gradients, which compiled layers cannot do; set train.compile=false or use "
                "parallel.pp_schedule=Interleaved1F1B (or 1F1B, GPipe)"]
    return []


def offload_errors(offload: str, *, fsdp: bool, finetune: str, optimizer: str) -> List[str]:
    """parallel.offload moves FSDP2's sharded state to host memory, so it needs FSDP2 sharding (with dp x cp = 1
    a 1-rank FSDP2 mesh carries it) and an optimizer that updates DTensor parameters (`optimizer`: optim._target_)."""
    if offload == "none":
        return []
    if not fsdp:
        return [f"parallel.offload={offload} offloads FSDP2's sharded parameters and optimizer states, but "
                "parallel.fsdp=false replicates them (DDP-like); set parallel.fsdp=true or parallel.offload=none"]
    if finetune == "qlora":
        return [f"parallel.offload={offload} with finetune=qlora is not supported (the frozen base is already 4-bit "
                "NF4 and the adapters' states are small); use finetune=lora with offload, or parallel.offload=none"]
    if optimizer.endswith("Adafactor"):
        return [f"parallel.offload={offload} with optim=adafactor: torch's Adafactor cannot update FSDP2's DTensor "
                "parameters; use optim=adamw or optim=sgd, or parallel.offload=none"]
    if offload == "params" and optimizer.endswith("MuonAdamW"):
        return ["parallel.offload=params with optim=muon: the update would gather every hidden matrix and run its "
                "Newton-Schulz iteration on the host, on every rank; use parallel.offload=optimizer (the update "
                "stays on the device) or optim=adamw"]
    return []


def sequence_errors(model, seq_len: int, *, tp: int, cp: int, sequence_parallel: bool) -> List[str]:
    """What keeps a training sequence of `seq_len` tokens from running: the model's positions, and the shards
    context parallel (2 x cp load-balanced chunks, each at least a Gated DeltaNet conv's carried inputs) and
    sequence parallel (tp) cut it into."""
    errors = []
    if seq_len > model.max_position_embeddings:
        errors.append(f"train.seq_len={seq_len} exceeds max_position_embeddings={model.max_position_embeddings} of "
                      f"model {model.name}; lower train.seq_len, or extend the model with model.rope_scaling "
                      "(e.g. yarn) and a larger model.max_position_embeddings")
    if cp > 1 and seq_len % (2 * cp):
        errors.append(f"train.seq_len={seq_len} must be divisible by 2 x parallel.cp = {2 * cp} (load-balanced "
                      f"causal chunks); pick a multiple of {2 * cp}")
    conv_tail = model.linear_conv_kernel_dim - 1
    if cp > 1 and "linear_attention" in model.layer_types and seq_len // (2 * cp) < conv_tail:
        errors.append(f"train.seq_len={seq_len} over parallel.cp={cp} leaves Gated DeltaNet chunks of "
                      f"{seq_len // (2 * cp)} tokens (2 x cp per sequence), fewer than the {conv_tail} conv inputs a "
                      f"chunk carries to the next; raise train.seq_len to {2 * cp * conv_tail} or more, or lower "
                      "parallel.cp")
    if tp > 1 and sequence_parallel and seq_len % tp:
        errors.append(f"train.seq_len={seq_len} must be divisible by parallel.tp={tp} with sequence parallel; pick "
                      f"a multiple of {tp} or set parallel.sequence_parallel=false")
    return errors


def batch_errors(*, global_batch: int, micro_batch: int, dp: int) -> List[str]:
    """A step's sequences split into micro-batches on every data-parallel rank."""
    if global_batch % (micro_batch * dp):
        return [f"train.global_batch_size={global_batch} is not divisible by train.micro_batch_size={micro_batch} x "
                f"parallel.dp={dp}; use a multiple of {micro_batch * dp}"]
    return []


def optimizer_layout_errors(optimizer: str, world: int) -> List[str]:
    """Training with optimizer `optimizer` (optim._target_) on `world` ranks."""
    if optimizer == "torch.optim.Adafactor" and world > 1:
        return [f"optim=adafactor runs in a single process (torch's Adafactor cannot update sharded DTensor "
                f"parameters), not on {world} ranks; use optim=adamw or optim=sgd here"]
    return []


def qlora_layout_errors(*, tp: int, pp: int, cp: int, ep: int, dp: int, fsdp: bool, name: str = "") -> List[str]:
    """finetune=qlora shards its NF4 base with FSDP2 only (torchao's NF4 weights have no other parallel form)."""
    unsharded = [f"parallel.{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)) if v > 1]
    if not fsdp and dp > 1:
        unsharded.append("parallel.fsdp=false")
    if unsharded:
        return [f"finetune=qlora shards its NF4 base with FSDP2 only, not under {', '.join(unsharded)} (torchao's "
                "NF4 weights have no tensor-, pipeline-, context- or expert-parallel form); use parallel=fsdp<N> or "
                f"parallel=single, or finetune=lora{f' for {name}' if name else ''}"]
    return []


def distill_layout_errors(*, pp: int, cp: int, tp: int, dp: int, fsdp: bool, teacher_quant: str = "none",
                          teacher_parallel: str = "same", name: str = "") -> List[str]:
    """task=distill runs without pipeline stages or context parallelism; a whole teacher (distill.teacher_parallel=
    replicate) goes with a student without TP (whose loss takes the teacher's output rows of its own rank); a
    quantized teacher is whole on every rank (distill.teacher_quant quantizes unsharded weights)."""
    if pp > 1 or cp > 1:
        return [f"task=distill runs without pipeline stages or context parallelism (parallel.pp={pp}, "
                f"parallel.cp={cp}); use parallel.pp=1 and parallel.cp=1 (fsdp / tp layouts)"]
    if teacher_parallel == "replicate" and tp > 1:
        return [f"distill.teacher_parallel=replicate keeps the teacher whole, but under parallel.tp={tp} the student's "
                "loss takes the teacher's vocabulary rows of its own rank; use distill.teacher_parallel=same"]
    if teacher_quant != "none" and teacher_parallel != "replicate" and (tp > 1 or fsdp and dp > 1):
        return [f"distill.teacher_quant={teacher_quant} quantizes a whole teacher, but parallel={name or 'the layout'} "
                f"shards it (tp={tp}, dp={dp}, fsdp={fsdp}); add distill.teacher_parallel=replicate (without tensor "
                "parallelism: each rank holds the whole int8 teacher), or use distill.teacher_quant=none"]
    return []


def dpo_layout_errors(*, pp: int) -> List[str]:
    """task=dpo scores a pair's two replies in one forward; it runs without pipeline stages."""
    if pp > 1:
        return [f"task=dpo does not run on pipeline stages (parallel.pp={pp}); use parallel.pp=1"]
    return []


def grpo_layout_errors(*, pp: int, cp: int, tp: int, dp: int, prompts_per_step: int, group_size: int,
                       mini_batches: int, num_experts: int, router_replay) -> List[str]:
    """task=grpo samples and trains on the same ranks: no pipeline stages or context parallelism; each data-parallel
    rank samples its share of the prompts and splits its completions into rl.mini_batches; router replay (MoE, on
    unless rl.router_replay=false) needs the tokens of a sequence on one rank, which tp's sequence shards are not."""
    if pp > 1 or cp > 1:
        return [f"task=grpo does not run on pipeline stages or context-parallel ranks (parallel.pp={pp}, "
                f"parallel.cp={cp}); use parallel.pp=1 and parallel.cp=1 (tp, ep and dp split it)"]
    if prompts_per_step % dp:
        return [f"rl.prompts_per_step={prompts_per_step} must be divisible by parallel.dp={dp} (each data-parallel "
                f"rank samples its share); use a multiple of {dp}"]
    rows = prompts_per_step // dp * group_size
    if rows % mini_batches:
        return [f"rl.mini_batches={mini_batches} must divide the {rows} completions of a rank "
                "(rl.prompts_per_step / parallel.dp x rl.group_size)"]
    if num_experts and router_replay is not False and tp > 1:
        return [f"rl.router_replay under parallel.tp={tp}: the MoE blocks route sequence shards; set "
                "rl.router_replay=false or use expert parallelism (parallel.ep) instead of tp"]
    return []


def inference_layout_errors(task: str, *, pp: int, cp: int, ep: int) -> List[str]:
    """Inference places the model with tensor parallelism only; data-parallel ranks split the prompts."""
    if pp > 1 or cp > 1 or ep > 1:
        return [f"task={task} runs tensor and data parallel only, not parallel.pp={pp} / cp={cp} / ep={ep}; "
                "use parallel=tp2 (or tp8, dp2, single) for inference"]
    return []
