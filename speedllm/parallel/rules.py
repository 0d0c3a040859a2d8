"""The rules a parallel layout must follow, as pure functions returning one-line messages (empty: it can run).

One home for them: validation raises the first message before any process starts, the planner's search skips
layouts that break one, and the tests assert the messages. Each message names the key(s) and the fix.
"""

from typing import List, Optional, Sequence

INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble",)  # two stages per pipeline rank, placed in a V (speedllm.parallel.pipeline)


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
    for heads_key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(m, heads_key)
        if heads % tp:
            errors.append(f"parallel.tp={tp} does not divide {heads_key}={heads} of model {name}; "
                          f"use tp in {_set(divisors(m.num_key_value_heads))}")
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


def inference_layout_errors(task: str, *, pp: int, cp: int, ep: int) -> List[str]:
    """Inference places the model with tensor parallelism only; data-parallel ranks split the prompts."""
    if pp > 1 or cp > 1 or ep > 1:
        return [f"task={task} runs tensor and data parallel only, not parallel.pp={pp} / cp={cp} / ep={ep}; "
                "use parallel=tp2 (or tp8, dp2, single) for inference"]
    return []
