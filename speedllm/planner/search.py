"""Search the layouts of a model on a device count: every valid tp, pp, vpp, dp, ep, cp, micro batch and
recompute policy is costed (memory of its busiest rank, step time) and ranked by estimated throughput.

Every rule is validation's own (speedllm.parallel.rules: heads % tp, stages, experts % ep, the combinations
speedllm.parallel.parallelize builds, the sequence against tp and cp, batch and micro-batch counts, offload, the
optimizer, QLoRA), called with the layout exactly as parallel=auto writes it into the config
(speedllm.planner.layout.apply_layout, the uneven stage split as parallel.pp_layers); the one choice of the
planner's own is where it looks: tensor parallel stays inside a node (it is on the critical path of every layer).
"""

from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import product
from types import SimpleNamespace
from typing import Dict, List, Optional

from omegaconf import OmegaConf

from speedllm.hardware import DTYPES
from speedllm.models.flops import layer_flops
from speedllm.models.kv_cache import cache_bytes
from speedllm.parallel.pipeline import stage_layers, stages_of_rank
from speedllm.parallel.rules import (
    batch_errors,
    divisors,
    layout_errors,
    offload_errors,
    optimizer_layout_errors,
    pipeline_batch_errors,
    qlora_layout_errors,
    sequence_errors,
)
from speedllm.planner.cpu_time import layer_and_rest_seconds
from speedllm.planner.layout import Layout, uneven
from speedllm.planner.memory import (
    GIB,
    Memory,
    adamw_state_numel,
    config_key,
    layer_activation_bytes,
    model_tensors,
    rank_memory,
    rank_params,
    tp_facts,
)
from speedllm.planner.spec import TRAINING, Rank, TaskSpec
from speedllm.planner.timing import StepTime, per_token, step_time
from speedllm.train.optimizer import ns_dtype, state_numel

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
CP_MODES = {False: ("allgather",), True: ("ring", "ulysses")}  # by cp > 1; ring needs no head split
VIRTUAL_STAGES = (1, 2, 4, 8)
# (parallel.offload, train.activation_offload) the search tries when no layout fits without offload
OFFLOAD_LEVERS = (("optimizer", False), ("none", True), ("optimizer", True), ("params", False), ("params", True))


@dataclass
class Problem:
    """What to plan: a model on `world` devices of one hardware profile, at a sequence length and batch."""

    model: object  # ModelConfig fields
    hardware: object  # HardwareConfig fields
    world: int
    seq_len: int
    global_batch: int
    loss_chunk: int = 0  # train.loss_chunk_size
    efficiency: float = 0.6
    memory_margin: float = 0.1
    optim: object = None  # OptimConfig fields; None: AdamW
    allow_offload: bool = True  # plan.allow_offload: offload to host memory when nothing fits without
    finetune: str = "full"  # finetune.name
    # the task planned for: its layout rules, the memory and time it adds (speedllm.planner.spec), and the run
    # config its declarations read (None: the TRAINING defaults read nothing)
    task: TaskSpec = TRAINING
    run: object = None

    @property
    def optimizer(self) -> str:
        return "torch.optim.AdamW" if self.optim is None else self.optim._target_

    @property
    def capacity(self) -> float:
        """Bytes per device a plan may use (the rest is kept for the runtime and allocator fragmentation)."""
        return self.hardware.memory_gb * GIB * (1 - self.memory_margin)

    @property
    def host_capacity(self) -> float:
        """Host bytes per device a plan may use: the node's RAM shared by its devices, less the same margin."""
        per_node = min(self.world, self.hardware.devices_per_node)
        return self.hardware.host_memory_gb * GIB * (1 - self.memory_margin) / per_node


@dataclass
class Estimate:
    layout: Layout
    memory: Memory  # the busiest pipeline rank
    time: StepTime
    tokens_per_s: float
    mfu: float
    bubble_fraction: float
    fits: bool
    reason: str = ""


@dataclass
class SearchResult:
    fitting: List[Estimate]  # fastest first
    too_big: List[Estimate]  # layouts that are valid but exceed device memory, fastest first
    invalid: Dict[str, int] = field(default_factory=dict)  # structural rejection reason -> layouts

    @property
    def best(self) -> Optional[Estimate]:
        return self.fitting[0] if self.fitting else None


class Planner:
    """Costs layouts of one Problem; per-rank parameter counts are cached by placement."""

    def __init__(self, problem: Problem):
        # typed objects: the search reads config fields millions of times, and DictConfig access is slow
        problem.model, problem.hardware = as_object(problem.model), as_object(problem.hardware)
        problem.optim = as_object(problem.optim)
        self.p = problem
        self.state_numel = adamw_state_numel if problem.optim is None else partial(state_numel, problem.optim)
        # optim=muon: (Newton-Schulz dtype, ns_steps), the gathered matrices' traffic, memory and compute
        self.muon = (ns_dtype(problem.optim, problem.hardware.device), problem.optim.ns_steps) \
            if problem.optimizer.endswith("MuonAdamW") else None
        self.mt = model_tensors(problem.model)
        self.tp_facts = tp_facts(self.mt)
        self._params = {}
        self._splits = {}
        self._imbalance = {}
        self.layer_flops = layer_flops(problem.model, problem.seq_len)
        # the frozen model the task holds beside the trained one (a teacher, a reference), read once
        self.frozen = None if problem.run is None else as_object(problem.task.frozen_model(problem.run))

    def split(self, layout: Layout, explicit=None) -> List[int]:
        """Layers per stage: `explicit` (parallel.pp_layers) or the run's own split by cost (stage_layers)."""
        key = (layout.pp * layout.vpp, None if explicit is None else tuple(explicit))
        if key not in self._splits:
            self._splits[key] = stage_layers(self.p.model, key[0], self.p.seq_len, key[1])
        return list(self._splits[key])

    def pipeline_imbalance(self, layout: Layout, split: List[int]) -> float:
        """The busiest pipeline rank's decoder-layer FLOPs over an even share of them (1.0: balanced)."""
        if layout.pp == 1:
            return 1.0
        key = (layout.pp, layout.vpp, layout.schedule, tuple(split))
        if key not in self._imbalance:
            starts = [sum(split[:i]) for i in range(len(split))]
            stage = [sum(self.layer_flops[a:a + n]) for a, n in zip(starts, split)]
            ranks = [sum(stage[s] for s in stages_of_rank(r, layout.pp, layout.vpp, layout.schedule))
                     for r in range(layout.pp)]
            self._imbalance[key] = max(ranks) * layout.pp / sum(ranks)
        return self._imbalance[key]

    def rank_params(self, layout: Layout, split: List[int]) -> list:
        key = (layout.tp, layout.pp, layout.vpp, layout.dp, layout.ep, layout.cp, layout.fsdp, tuple(split))
        if key not in self._params:
            self._params[key] = [rank_params(self.mt, layout, split, r, self.state_numel) for r in range(layout.pp)]
        return self._params[key]

    def rank_memories(self, layout: Layout, explicit_split=None) -> List[Memory]:
        """Memory of every pipeline rank (the first rank of each of its other axes) under `layout`."""
        p = self.p
        stages = self.rank_params(layout, self.split(layout, explicit_split))
        muon_bytes = DTYPES[self.muon[0]].itemsize if self.muon else 0
        k = p.task.rows_per_item
        return [replace(rank_memory(p.model, self.rows(layout), sp, r, p.seq_len, p.global_batch * k,
                                    p.hardware.dtype, p.loss_chunk, self.tp_facts, p.hardware.ops,
                                    p.hardware.device, muon_bytes),
                        **p.task.memory(p.run, self.frozen, self.rank(layout, sp)))
                for r, sp in enumerate(stages)]

    def rank(self, layout: Layout, sp) -> Rank:
        return Rank(layout, sp, self.p.seq_len, self.p.hardware, self.p.efficiency)

    def rows(self, layout: Layout) -> Layout:
        """`layout` with its micro-batch in the model's rows (TaskSpec.rows_per_item: a DPO pair is two)."""
        return replace(layout, micro_batch=layout.micro_batch * self.p.task.rows_per_item)

    def estimate(self, layout: Layout, explicit_split=None) -> Estimate:
        """Memory of the busiest rank and step time of `layout` (assumed structurally valid)."""
        p, m = self.p, self.p.model
        split = self.split(layout, explicit_split)
        stages = self.rank_params(layout, split)
        memory = max(self.rank_memories(layout, explicit_split), key=lambda mem: mem.total)
        busiest = max(stages, key=lambda sp: sp.gathered)
        rows, batch = self.rows(layout), p.global_batch * p.task.rows_per_item  # in the model's rows
        selective = 0.0
        if layout.recompute == "selective":
            e = DTYPES[p.hardware.dtype].itemsize
            kept = replace(rows, recompute="none")
            moe = m.num_experts > 0
            ops = p.hardware.ops
            selective = (layer_activation_bytes(m, kept, p.seq_len, e, moe, self.tp_facts, ops)
                         - layer_activation_bytes(m, rows, p.seq_len, e, moe, self.tp_facts, ops))
        measured = None
        if p.hardware.device == "cpu":  # this CPU (its profile is the probe's): time the model on it
            measured = layer_and_rest_seconds(config_key(m), rows.micro_batch, p.seq_len, p.hardware.dtype,
                                              p.hardware.ops)
        time = step_time(m, rows, p.hardware, busiest, p.seq_len, batch, p.efficiency, selective,
                         memory.offloaded_per_layer, self.muon, measured, self.pipeline_imbalance(layout, split))
        time.task = p.task.extra_seconds(p.run, self.frozen, self.rank(layout, busiest))
        tokens_per_s = batch * p.seq_len / time.total
        mfu = tokens_per_s * per_token(m, p.seq_len)[0] / (p.hardware.peak_tflops[p.hardware.dtype] * 1e12
                                                                 * layout.world)
        fits = memory.total <= p.capacity and memory.host <= p.host_capacity
        if memory.total > p.capacity:
            reason = (f"needs {memory.total / GIB:.1f} GiB on pp rank {memory.pp_rank} > {p.capacity / GIB:.1f} GiB "
                      f"usable ({largest(memory)})")
        else:
            reason = "" if fits else (f"needs {memory.host / GIB:.1f} GiB of host memory per device > "
                                      f"{p.host_capacity / GIB:.1f} GiB (hardware.host_memory_gb per node)")
        return Estimate(layout, memory, time, tokens_per_s, mfu, time.bubble / time.total, fits, reason)

    def invalid_reason(self, layout: Layout) -> Optional[str]:
        """Why a layout cannot run (None: it can), in the words of the config key to change: the rules validation
        applies (speedllm.parallel.rules) to the layout as parallel=auto would write it, then the planner's own
        bound (tensor parallel inside a node)."""
        m, p, lay = self.p.model, self.p, layout
        errors = layout_errors(m, tp=lay.tp, pp=lay.pp, vpp=lay.vpp, ep=lay.ep, cp=lay.cp, dp=lay.dp,
                               schedule=lay.schedule, pp_layers=uneven(self.split(lay)), cp_mode=lay.cp_mode,
                               sequence_parallel=lay.sequence_parallel)
        if p.task.train_batches:
            errors += sequence_errors(m, p.seq_len, tp=lay.tp, cp=lay.cp, sequence_parallel=lay.sequence_parallel)
            errors += batch_errors(global_batch=p.global_batch, micro_batch=lay.micro_batch, dp=lay.dp)
            errors += pipeline_batch_errors(pp=lay.pp, vpp=lay.vpp, schedule=lay.schedule, pp_microbatches=0,
                                            global_batch=p.global_batch, micro_batch=lay.micro_batch, dp=lay.dp)
        errors += offload_errors(lay.offload, fsdp=lay.fsdp, finetune=p.finetune, optimizer=p.optimizer)
        errors += optimizer_layout_errors(p.optimizer, lay.world)
        errors += p.task.layout_errors(p.run, lay, self.frozen)
        if p.finetune == "qlora":
            errors += qlora_layout_errors(tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=lay.ep, dp=lay.dp, fsdp=lay.fsdp)
        if lay.tp > p.hardware.devices_per_node:
            errors.append(f"parallel.tp={lay.tp} would span nodes ({p.hardware.devices_per_node} devices per node)")
        return errors[0] if errors else None

    def layouts(self):
        """Every combination of degrees whose product is the device count."""
        m, world = self.p.model, self.p.world
        experts = divisors(m.num_experts) if m.num_experts else [1]
        cps = [c for c in divisors(world) if c <= 64 and (c == 1 or self.p.seq_len >= 8192)]
        for tp in divisors(world):
            for cp in [c for c in cps if (world // tp) % c == 0]:
                for pp in divisors(world // (tp * cp)):
                    dp = world // (tp * cp * pp)
                    # no stage without a layer: parallel.pp_layers could not say it
                    for vpp in [v for v in VIRTUAL_STAGES if pp * v <= m.num_hidden_layers] if pp > 1 else (1,):
                        schedule = "Interleaved1F1B" if vpp > 1 else "1F1B"
                        # a task that fixes its micro-batch (task=grpo: a mini-batch of the rank's completions)
                        micro = MICRO_BATCHES if self.p.task.micro_batch is None else \
                            (self.p.task.micro_batch(self.p.run, dp),)
                        for ep in [x for x in experts if x <= dp * cp * tp]:
                            for mb, recompute, cp_mode in product(micro, RECOMPUTE, CP_MODES[cp > 1]):
                                yield Layout(dp=dp, tp=tp, pp=pp, vpp=vpp, ep=ep, cp=cp, cp_mode=cp_mode,
                                             micro_batch=mb, recompute=recompute, schedule=schedule)

    def inference_layout(self) -> Optional[Estimate]:
        """Generation / serving: the fewest tensor-parallel ranks (inference places the model with tensor
        parallelism only: speedllm.parallel.rules.inference_layout_errors) whose weights in the compute dtype, KV
        cache and logits for the workload's global_batch sequences of seq_len tokens (its SPEC's: generate.batch_size
        prompts plus generate.max_new_tokens, serve.max_batch slots of serve.max_len) fit; the remaining devices
        replicate it (dp)."""
        m, p = self.p.model, self.p
        e = DTYPES[p.hardware.dtype].itemsize
        batch, length = p.global_batch, p.seq_len
        for tp in divisors(p.world):
            layout = Layout(dp=p.world // tp, tp=tp, micro_batch=batch, fsdp=False)
            if layout_errors(m, tp=tp, pp=1, vpp=1, ep=1, cp=1, dp=layout.dp, schedule=layout.schedule) \
                    or p.task.layout_errors(p.run, layout, self.frozen) or tp > p.hardware.devices_per_node:
                continue
            split = self.split(layout)
            sp = max(self.rank_params(layout, split), key=lambda s: s.gathered)
            kv_cache = cache_bytes(m, batch, length, e, tp)
            logits = batch * length * m.vocab_size / tp * 4
            memory = Memory(params=sp.gathered * e, activations=kv_cache + logits)
            if memory.total <= p.capacity:
                return Estimate(layout, memory, StepTime(), 0.0, 0.0, 0.0, True)
        return None

    def search(self) -> SearchResult:
        """Every layout without offload; only when none of them fits (and plan.allow_offload, on a device that is
        not the host itself), the same layouts again with each offload lever."""
        result = self._search(self.layouts())
        if result.best is None and self.p.allow_offload and self.p.hardware.device != "cpu":
            levers = (replace(layout, offload=offload, activation_offload=activations)
                      for layout in self.layouts() for offload, activations in OFFLOAD_LEVERS)
            with_offload = self._search(levers)
            with_offload.invalid = result.invalid
            return with_offload
        return result

    def _search(self, layouts) -> SearchResult:
        fitting, too_big, invalid = [], [], Counter()
        for layout in layouts:
            reason = self.invalid_reason(layout)
            if reason is not None:
                invalid[reason.split(" (")[0]] += 1
                continue
            est = self.estimate(layout)
            (fitting if est.fits else too_big).append(est)
        def order(est):  # fastest first; among equals the one with the most free memory
            return (-est.tokens_per_s, est.memory.total)
        return SearchResult(sorted(fitting, key=order), sorted(too_big, key=order), dict(invalid))


def as_object(node):
    """A config node as its schema's dataclass (a composed, untyped-yet config comes as DictConfig)."""
    return OmegaConf.to_object(node) if OmegaConf.is_config(node) else node


def largest(memory: Memory) -> str:
    """The biggest components of a memory estimate, e.g. `activations 40.1 GiB, optimizer 20.3 GiB`."""
    names = {"params": "params", "grads": "grads", "grad_accum": "accumulated grads", "optimizer": "optimizer",
             "activations": "activations", "buffers": "buffers"}
    parts = sorted(((getattr(memory, k), name) for k, name in names.items()), reverse=True)
    return ", ".join(f"{name} {value / GIB:.1f} GiB" for value, name in parts[:2])


def problem_from_config(cfg, world: int, task: TaskSpec = TRAINING) -> Problem:
    """The planning problem a composed config describes for `task` (its module's SPEC), on `world` devices: the
    step's tokens per sequence and sequences from the task's workload."""
    run = plain_sections(cfg)
    seq_len, global_batch = task.workload(run)
    return Problem(model=cfg.model, hardware=cfg.hardware, world=world, seq_len=seq_len, global_batch=global_batch,
                   loss_chunk=cfg.train.loss_chunk_size, efficiency=cfg.plan.compute_efficiency,
                   memory_margin=cfg.plan.memory_margin, optim=cfg.optim, allow_offload=cfg.plan.allow_offload,
                   finetune=cfg.finetune.name, task=task, run=run)


def plain_sections(cfg):
    """A composed config's sections as their schema dataclasses, which the search reads fast for every layout; a
    typed run config as it is. run_dir and checkpoint (checkpoint.dir defaults under run_dir) stay config nodes:
    their defaults need Hydra's app to resolve."""
    if not OmegaConf.is_config(cfg):
        return cfg
    return SimpleNamespace(**{key: cfg._get_node(key) if key in ("run_dir", "checkpoint") else as_object(cfg[key])
                              for key in cfg})
