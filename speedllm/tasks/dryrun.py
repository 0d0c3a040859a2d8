"""task=dryrun: build ranks of the real training job without its devices and print what each one holds.

    python launch.py task=dryrun model=qwen3_235b_a22b parallel=pp4_ep32 hardware=npu_a2 \
        launcher.nnodes=16 launcher.nproc_per_node=16 [dryrun.ranks=[0,255]]

For each simulated rank (dryrun.ranks; by default the first and the last rank of the first and of the last
pipeline stage, which hold the first and the last experts) this process joins torch's fake process group as
that rank of the launcher's world (collectives do nothing), builds the device mesh, the model on the meta
device and parallelizes it exactly as training does (speedllm.train.build.meta_model: stage split, TP plans,
expert placement, FSDP2), then the optimizer over it. Nothing is allocated.

Per rank it prints the mesh coordinates, the pipeline stages, decoder layers and experts the rank holds, and
the bytes of its parameters, gradients (sharded like the parameters) and optimizer states, on the device and on
the host (parallel.offload moves them: speedllm.planner.memory.placed), beside the planner's exact bytes for the
same layout (speedllm.planner.memory). The planner costs the first rank of each axis,
which holds the most when a dimension does not split evenly (torch.chunk gives later ranks fewer rows).
"""

import time
from dataclasses import dataclass, replace
from functools import partial
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from speedllm.adapters.lora import adapter_fn
from speedllm.parallel.mesh import AXES
from speedllm.parallel.pipeline import stage_layers
from speedllm.planner.layout import layout_from_config
from speedllm.planner.memory import MASTER_BYTES, model_tensors, placed, rank_params, state_text, teacher_bytes
from speedllm.planner.spec import PLANNING
from speedllm.runtime import init_fake_runtime
from speedllm.train.optimizer import build_optimizer, state_numel


@dataclass
class RankReport:
    """What one rank of the job holds, as built."""

    rank: int
    coords: dict  # mesh axis -> (coordinate, size), and "ep" when experts are split
    stages: List[int]
    layers: List[int]
    moe_layers: int
    embed: bool
    head: bool
    experts: Tuple[int, int] = (0, 0)  # [first, last) expert ids of this rank's MoE layers
    expert_shards: int = 1  # ranks that shard these experts further with FSDP2 (edp)
    params: int = 0  # bytes
    grads: int = 0
    optimizer: int = 0
    offload: str = "none"  # parallel.offload: which of them live in host memory
    # the planner's (params, grads, optimizer) bytes; None: it costs full training, not these adapters
    planned: Optional[Tuple[int, int, int]] = None
    teacher: Optional[Tuple[int, int]] = None  # distill.teacher: (bytes of its weights held here, the planner's)


def sample_ranks(parallel, world: int) -> List[int]:
    """The first and the last rank of the first and of the last pipeline stage: first and last coordinate on
    every other axis, so the first and the last expert group too."""
    per_stage = world // parallel.pp
    return sorted({0, per_stage - 1, world - per_stage, world - 1})


def planned_bytes(cfg, pp_rank: int) -> Tuple[int, int, int]:
    """The planner's (params, grads, optimizer) bytes of pipeline rank `pp_rank` (its first rank per axis)."""
    layout = layout_from_config(cfg.parallel, cfg.train)
    split = stage_layers(cfg.model, layout.pp * layout.vpp, cfg.train.seq_len, cfg.parallel.pp_layers)
    sp = rank_params(model_tensors(cfg.model), layout, split, pp_rank, partial(state_numel, cfg.optim))
    return sp.sharded * MASTER_BYTES, sp.sharded * MASTER_BYTES, sp.optimizer_state * MASTER_BYTES


def build_rank(cfg, rank: int, world: int) -> RankReport:
    """Rank `rank` of the `world`-rank job, built on the fake process group with the model on the meta device."""
    from speedllm.train.build import meta_model

    # kernels do not change what a rank holds, and the profile's op set (torch_npu) may not import here
    cfg = replace(cfg, hardware=replace(cfg.hardware, ops="reference"))
    rt = init_fake_runtime(cfg, rank, world)
    dims = rt.dims
    pm = meta_model(cfg, rt, adapter_fn(cfg.finetune))
    if pm.pipeline is not None:
        pm.pipeline.retie()  # as materialize does: a last stage's tied embedding is its (sharded) head
    optimizer = build_optimizer(pm.module, cfg.optim)
    coords = {axis: (rt.mesh[axis].get_local_rank(), rt.mesh[axis].size()) for axis in AXES}
    stages = [index for index, _ in pm.pipeline.stages] if pm.pipeline is not None else [0]
    layers = sorted(int(i) for i in pm.module.layers)
    report = RankReport(rank, coords, stages, layers, sum(pm.module.layers[str(i)].is_moe for i in layers),
                        pm.module.embed_tokens is not None and 0 in stages,
                        pm.module.lm_head is not None or pm.module.norm is not None, offload=cfg.parallel.offload)
    if dims.ep > 1:
        ep_mesh, edp_mesh = dims.expert_meshes()
        per_rank = cfg.model.num_experts // dims.ep
        first = ep_mesh.get_local_rank() * per_rank
        coords["ep"] = (ep_mesh.get_local_rank(), dims.ep)
        report.experts, report.expert_shards = (first, first + per_rank), edp_mesh.size()
    elif cfg.model.num_experts:
        report.experts, report.expert_shards = (0, cfg.model.num_experts), 0
    report.params = sum(local_bytes(p) for p in pm.module.parameters())
    for group in optimizer.param_groups:
        for p in group["params"]:
            report.grads += local_bytes(p)  # FSDP2 reduce-scatters to the param's shard
            local = p.to_local() if isinstance(p, DTensor) else p
            report.optimizer += (state_numel(cfg.optim, tuple(local.shape), group.get("muon", False))
                                 * local.element_size())
    if cfg.finetune.name == "full":
        report.planned = planned_bytes(cfg, coords["pp"][0])
    if cfg.distill.teacher is not None:
        report.teacher = built_teacher_bytes(cfg, rt)
    return report


def built_teacher_bytes(cfg, rt) -> Tuple[int, int]:
    """(bytes of the frozen teacher's weights this rank holds, built as task=distill builds it
    (speedllm.train.teacher) on the meta device; the planner's bytes for them)."""
    from speedllm.models.qwen3 import Qwen3
    from speedllm.quant.int8 import Int8Linear
    from speedllm.train.build import meta_model
    from speedllm.train.teacher import quantize_teacher, teacher_run_config, teacher_source, whole_teacher

    tcfg = teacher_run_config(cfg, teacher_source(str(cfg.distill.teacher)))
    if whole_teacher(cfg):
        with torch.device("meta"):
            teacher = Qwen3(tcfg.model)
    else:
        teacher = meta_model(tcfg, rt).module
    quantize_teacher(teacher, cfg.distill.teacher_quant, device=torch.device("cpu"))  # our int8 layers, on meta
    int8 = [t for m in teacher.modules() if isinstance(m, Int8Linear) for t in (m.qweight, m.scale)]
    held = sum(local_bytes(t) for t in [*teacher.parameters(), *int8])
    layout = layout_from_config(cfg.parallel, cfg.train)
    return held, int(teacher_bytes(tcfg.model, layout, cfg.hardware.dtype, gathered=False,
                                   quant=cfg.distill.teacher_quant, whole=whole_teacher(cfg)))


def local_bytes(p) -> int:
    local = p.to_local() if isinstance(p, DTensor) else p
    return local.numel() * local.element_size()


def spans(ids: List[int]) -> str:
    """`0-22` / `0-2, 16-18` for sorted ids."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x > start else str(start))
            start = None
    return ", ".join(out)


def line(r: RankReport) -> str:
    """One line per rank that names it."""
    coords = " ".join(f"{axis} {c}/{n}" for axis, (c, n) in r.coords.items())
    ends = [name for name, held in (("embedding", r.embed), ("head", r.head)) if held]
    held = f"stage{'s' if len(r.stages) > 1 else ''} {spans(r.stages)}: layers {spans(r.layers)} " \
           f"({len(r.layers)}, {r.moe_layers} MoE)" + "".join(f" + {e}" for e in ends)
    if r.moe_layers:
        first, last = r.experts
        held += f"; experts {spans(list(range(first, last)))}"
        if r.expert_shards > 1:
            held += f" sharded over {r.expert_shards}"
    mine = placed((r.params, r.grads, r.optimizer), r.offload)
    if r.planned is None:
        check = "task=plan costs full training, not these adapters"
    elif mine == placed(r.planned, r.offload):
        check = "= task=plan's exact bytes"
    else:
        check = "task=plan (first rank of this stage): " + state_text(*placed(r.planned, r.offload))
    teacher = ""
    if r.teacher is not None:
        built, planned = r.teacher
        same = "= task=plan's" if built == planned else f"task=plan: {planned / 2**20:.1f} MiB"
        teacher = f" | teacher weights {built / 2**20:.1f} MiB ({same})"
    return f"rank {r.rank} [{coords}] {held} | {state_text(*mine)} | {check}{teacher}"


def run(cfg, rt) -> None:
    """Build and report every rank of cfg.dryrun.ranks (default: sample_ranks) of the launcher's world."""
    p, lc = cfg.parallel, cfg.launcher
    world = lc.nnodes * lc.nproc_per_node
    ranks = list(cfg.dryrun.ranks) if cfg.dryrun.ranks is not None else sample_ranks(p, world)
    print(f"dryrun: {cfg.model.name}, {layout_from_config(p, cfg.train).short()} on {world} ranks (fake process "
          f"group, model on the meta device); per rank: fp32 parameters, gradients, optimizer states "
          f"({cfg.optim.name}) on the device and in host memory (parallel.offload={p.offload})")
    start = time.perf_counter()
    try:
        for rank in ranks:
            print(line(build_rank(cfg, rank, world)), flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"dryrun: {len(ranks)} rank(s) built in {time.perf_counter() - start:.1f} s")


SPEC = PLANNING  # builds the ranks of a layout (parallel=auto: plan.task's), not a step's batch
