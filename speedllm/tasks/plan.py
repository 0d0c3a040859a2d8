"""task=plan: print the ranked layouts of a model on the devices the launcher names, and why others were rejected.

    python launch.py task=plan model=qwen3_235b_a22b hardware=npu_a2 launcher.nnodes=16 launcher.nproc_per_node=16
    python launch.py task=plan plan.task=grpo model=qwen3_8b hardware=h100 launcher.nproc_per_node=8

The layouts are those plan.task (default pretrain) accepts, costed with the memory and work its SPEC declares
(speedllm.planner.spec: a teacher, a reference, a rollout's cache and decode); an inference task gets its placement.

The device count is launcher.nnodes x launcher.nproc_per_node (nproc_per_node=0: the profile's devices per
node). Nothing starts on any device: the planner builds the model on the meta device only.
"""

import time

from omegaconf import DictConfig

from speedllm.planner import device_count
from speedllm.planner.layout import layout_from_config
from speedllm.planner.memory import GIB, placed_state_bytes, state_text
from speedllm.planner.search import Estimate, Planner, SearchResult, problem_from_config
from speedllm.planner.spec import PLANNING
from speedllm.tasks import planned_spec

COMPONENTS = ("params", "grads", "grad_accum", "optimizer", "activations", "buffers", "task", "host")
HEADER = (f"{'#':>3}  {'layout':<48} {'GiB/dev':>7}  {'params':>6} {'grads':>6} {'accum':>6} {'optim':>6} "
          f"{'activ':>6} {'buffers':>7} {'task':>6} {'host':>6}  {'step s':>8} {'tokens/s':>11} {'MFU':>6} "
          f"{'bubble':>6}")


def row(rank: str, est: Estimate) -> str:
    m = est.memory
    parts = " ".join(f"{getattr(m, k) / GIB:{7 if k == 'buffers' else 6}.1f}" for k in COMPONENTS)
    return (f"{rank:>3}  {est.layout.short():<48} {m.total / GIB:7.1f}  {parts}  {est.time.total:8.3g} "
            f"{est.tokens_per_s:11,.0f} {est.mfu:6.1%} {est.bubble_fraction:6.1%}")


def format_table(cfg: DictConfig, planner: Planner, result: SearchResult, seconds: float, mine=None) -> str:
    """The ranked table, the fastest rejected layouts with their reason, and the structural rejections."""
    p = planner.p
    costed = len(result.fitting) + len(result.too_big)
    lines = [f"plan: {cfg.model.name} on {p.world} x {cfg.hardware.name} ({p.hardware.memory_gb:g} GiB each, "
             f"{p.capacity / GIB:.1f} usable), seq_len {p.seq_len}, global batch {p.global_batch}, "
             f"{p.hardware.dtype}: {costed} layouts costed, {len(result.fitting)} fit ({seconds:.1f} s)",
             "GiB/dev: peak of the busiest rank (forward/backward or update); accum: gradients accumulating over "
             "micro-batches; task: what the task adds (a teacher or reference, a rollout cache, logits); host: what offload keeps in host memory per device; time, tokens/s and MFU estimated "
             "from the hardware profile", HEADER]
    lines += [row(str(i + 1), est) for i, est in enumerate(result.fitting[: cfg.plan.top])]
    if result.best is not None:
        lines.append(f"#1 on pp rank {result.best.memory.pp_rank}: {state_bytes(planner, result.best)}")
    if mine is not None:
        lines += ["your layout (parallel=" + cfg.parallel.name + "):", row("-", mine)]
        if not mine.fits:
            lines.append(f"     rejected: {mine.reason}")
    if result.too_big and cfg.plan.show_rejected > 0:
        # the interesting rejections are those that would have been faster than the choice
        best = result.best
        faster = [e for e in result.too_big if best is None or e.tokens_per_s > best.tokens_per_s]
        lines.append(f"rejected: {'faster than #1 but ' if faster else ''}too big for device memory "
                     "(closest to fitting first):")
        shown = sorted(faster or result.too_big, key=lambda e: e.memory.total)[: cfg.plan.show_rejected]
        lines += [f"     {est.layout.short():<48} {est.tokens_per_s:11,.0f} tokens/s  {est.reason}" for est in shown]
    if result.invalid:
        lines.append("rejected as invalid (layouts: reason):")
        lines += [f"     {count:6d}: {reason}" for reason, count in sorted(result.invalid.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)


def state_bytes(planner: Planner, est: Estimate) -> str:
    """The exact bytes of the parameters, gradients and optimizer states on the device and on the host of the
    estimate's busiest pipeline rank, as task=dryrun prints them for the same layout."""
    sp = planner.rank_params(est.layout, planner.split(est.layout))[est.memory.pp_rank]
    return state_text(*placed_state_bytes(sp, est.layout.offload))


def demo_sized_note(cfg: DictConfig):
    """A plan for a real model with the demo's sequence length and batch says what to pass instead (or None)."""
    t, m = cfg.train, cfg.model
    if t.seq_len >= 1024 or m.hidden_size < 1024:  # real settings, or a demo-sized model
        return None
    seq_len = min(4096, m.max_position_embeddings)
    return (f"note: planning {m.name} with train.seq_len={t.seq_len} and train.global_batch_size="
            f"{t.global_batch_size}, the CPU demo's sizes; for a real run pass e.g. train.seq_len={seq_len} "
            f"train.global_batch_size={(1 << 22) // seq_len} (about 4M tokens per step)")


def run(cfg: DictConfig, rt) -> None:
    """Print the plan of plan.task for cfg.model on device_count(cfg) devices of cfg.hardware."""
    start = time.perf_counter()
    spec = planned_spec(cfg)
    problem = problem_from_config(cfg, device_count(cfg), spec)
    if spec.inference:
        best = Planner(problem).inference_layout()
        print(f"plan: task={cfg.plan.task} {cfg.model.name} on {problem.world} x {cfg.hardware.name}: "
              + (f"{best.layout.short()}, {best.memory.total / GIB:.1f} GiB per device" if best is not None else
                 f"no layout fits; add devices or lower {spec.workload_keys}"))
        return
    note = demo_sized_note(cfg) if spec.train_batches else None
    if note is not None:
        print(note)
    if problem.global_batch < problem.world and spec.train_batches:
        # every layout would leave devices without a sequence; plan the smallest batch that feeds them all
        print(f"note: train.global_batch_size={problem.global_batch} is smaller than the {problem.world} devices; "
              f"planning with {problem.world} (set train.global_batch_size to plan another)")
        problem.global_batch = problem.world
    planner = Planner(problem)
    result = planner.search()
    mine, note = None, None
    if cfg.parallel.name != "auto":
        layout = layout_from_config(cfg.parallel, cfg.train)
        reason = planner.invalid_reason(layout)
        if layout.world != planner.p.world:
            note = f"parallel={cfg.parallel.name} uses {layout.world} devices, not {planner.p.world}: not costed"
        elif reason is not None:
            note = f"parallel={cfg.parallel.name} is not costed: {reason}"
        else:
            mine = planner.estimate(layout, cfg.parallel.pp_layers)
    print(format_table(cfg, planner, result, time.perf_counter() - start, mine))
    if cfg.quant.name != "none":
        from speedllm.planner.memory import inference_weight_bytes

        tp = cfg.parallel.tp
        quantized, plain = inference_weight_bytes(cfg.model, cfg.quant, cfg.hardware.dtype, tp)
        print(f"inference weights with quant={cfg.quant.name}: {quantized / GIB:.2f} GiB "
              f"({quantized / plain:.2f}x of {plain / GIB:.2f} GiB in {cfg.hardware.dtype})"
              + (f" per rank of parallel.tp={tp}" if tp > 1 else ""))
    if cfg.finetune.name != "full":
        from speedllm.checkpoint.adapters import base_bytes

        facts = base_bytes(cfg.model, cfg.finetune)
        print(f"finetune={cfg.finetune.name}: frozen base {facts['base_params'] / 1e6:,.1f}M params at "
              f"{facts['base_bytes'] / facts['base_params']:.3f} bytes/param ({facts['base_bytes'] / GIB:.2f} GiB), "
              f"adapters {facts['adapter_params'] / 1e6:,.2f}M params trained (the table costs full training)")
    if note is not None:
        print(note)
    if result.best is None:
        offload = "offload was not considered (plan.allow_offload=false)" if not cfg.plan.allow_offload else \
            "not even with offload to host memory"
        print(f"no layout fits ({offload}): add devices (launcher.nnodes) or lower {spec.workload_keys}")


SPEC = PLANNING  # the layouts, memory and step of plan.task
