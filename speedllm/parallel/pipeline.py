"""Pipeline parallelism with torch.distributed.pipelining: stage splitting and one training step.

A stage is the Qwen3 module with the other stages' layers deleted and embed_tokens / norm / lm_head set to
None where it does not hold them (names, and so checkpoints, stay those of the whole model). Stages go to
pipeline ranks round-robin (stage s on rank s % pp; rank r and 2*pp-1-r for the V-shaped schedules), so with
vpp virtual stages a rank holds several. The model the loop sees is one module holding every layer of this
rank (for the optimizer and checkpoints); the stages share its submodules.

Tied embeddings (input = output embedding) are two tensors here, embed_tokens on the first stage and lm_head
on the last: both start equal, their gradients are summed over the pipeline axis after every step, and the
optimizer therefore keeps them equal.

MoE models: the load-balancing loss E * sum_e (A_e / R) (P_e / R) multiplies totals over ALL MoE layers
(assignments A, router probability mass P, tokens R), so it is not a sum of per-layer terms. A stage passes the
running totals on as a second activation beside the hidden states, a [3, E] tensor (speedllm.models.moe
pack_stats; each stage adds its layers in layer order, so the totals are the single process's bit for bit),
and the last stage computes the loss from them. The schedule's point-to-point backward then carries
dL/dP = E * A / R^2 (times the loss scale) back to the stage owning each layer by plain autograd: exact under
every schedule, with no extra collective. (Megatron's alternative, attaching each layer's share of the global
loss's gradient in backward, needs every micro-batch's totals A and R, known only after the last stage's forward,
on every earlier stage before its backward: a message outside the schedule per micro-batch, which the second
activation replaces.)
"""

import copy
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor, Shard

from speedllm.hardware import DTYPES
from speedllm.models.flops import layer_flops
from speedllm.models.moe import take_expert_load
from speedllm.parallel.rules import V_SCHEDULES


def stage_layers(model, num_stages: int, seq_len: int, explicit: Optional[Sequence[int]] = None) -> List[int]:
    """Decoder layers per pipeline stage (pp * vpp stages): the one split the run, the planner and the dry run use.

    `explicit` sizes (parallel.pp_layers), or each layer costed by its own kind's training FLOPs per token at
    `seq_len` (speedllm.models.flops: attention's scores grow with the length, a Gated DeltaNet layer's rule does
    not; a MoE MLP by its active experts): the costliest stage as cheap as it can be, then the stages' costs as
    even as they can be. Layers of one cost: as even as possible, the larger stages in the middle (the first
    holds the embedding, the last the output projection and loss).
    """
    if explicit is not None:
        return list(explicit)
    return list(balanced_split(tuple(layer_flops(model, seq_len)), num_stages))


@lru_cache(maxsize=1024)
def balanced_split(costs: Tuple[float, ...], num_stages: int) -> Tuple[int, ...]:
    """Sizes of `num_stages` contiguous groups of `costs`: the largest group sum minimal, then the sum of squared
    group sums minimal (two passes of a dynamic program over the split points); equal costs as described above."""
    n = len(costs)
    if len(set(costs)) <= 1 or num_stages >= n:
        base, extra = divmod(n, num_stages)
        start = (num_stages - extra) // 2
        return tuple(base + (start <= i < start + extra) for i in range(num_stages))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def solve(score, bound):
        """best[s][j]: the best score of the first j layers in s stages, each at most `bound`; and its last cut."""
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for s in range(1, num_stages + 1):
            for j in range(s, n - (num_stages - s) + 1):
                for i in range(s - 1, j):
                    stage = prefix[j] - prefix[i]
                    if best[s - 1][i] == inf or stage > bound:
                        continue
                    value = score(best[s - 1][i], stage)
                    if value < best[s][j]:
                        best[s][j], cut[s][j] = value, i
        return best[num_stages][n], cut

    largest, _ = solve(max, float("inf"))
    _, cut = solve(lambda total, stage: total + stage * stage, largest)
    sizes, j = [], n
    for s in range(num_stages, 0, -1):
        sizes.append(j - cut[s][j])
        j = cut[s][j]
    return tuple(reversed(sizes))


def stages_of_rank(pp_rank: int, pp: int, vpp: int, schedule: str) -> List[int]:
    """Stage indices held by pipeline rank `pp_rank`."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(vpp)]


def stage_module(model: nn.Module, layer_ids: List[int], first: bool, last: bool) -> nn.Module:
    """A shallow copy of `model` holding only `layer_ids` (+ embedding / final norm and head at the ends)."""
    stage = copy.copy(model)
    for key, value in vars(model).items():
        if isinstance(value, dict):  # own tables of submodules, parameters and hooks; shared submodules
            setattr(stage, key, copy.copy(value))
    stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
    if not first:
        stage.embed_tokens = None
    if not last:
        stage.norm = None
        stage.lm_head = None
    return stage


def split_model(model: nn.Module, parallel, seq_len: int, pp_rank: int) -> tuple:
    """(rank module, [(stage index, stage module)]) for this pipeline rank; `model` is on the meta device.

    `parallel` is the layout (schema ParallelConfig), already validated (speedllm.parallel.rules); `seq_len`
    (train.seq_len) prices the layers for the stage split (stage_layers).
    """
    p = parallel
    num_stages = p.pp * p.vpp
    sizes = stage_layers(model.cfg, num_stages, seq_len, p.pp_layers)
    starts = [sum(sizes[:i]) for i in range(num_stages)]
    all_layers = [list(range(start, start + size)) for start, size in zip(starts, sizes)]
    mine = stages_of_rank(pp_rank, p.pp, p.vpp, p.pp_schedule)
    owned = sorted(i for s in mine for i in all_layers[s])
    holds_first, holds_last = 0 in mine, num_stages - 1 in mine
    rank_module = stage_module(model, owned, holds_first, holds_last)
    if holds_last and model.cfg.tie_word_embeddings:
        # The first and last stages are separate modules (separate FSDP units): the head gets its own
        # tensor, kept equal to embed_tokens by summing their gradients.
        rank_module.lm_head = copy.deepcopy(model.lm_head)
        if not holds_first:
            # Still tied within this rank's module (as in the whole model), so state dicts and checkpoints
            # name it exactly as a single process does; the stage itself holds only lm_head.
            rank_module.embed_tokens = copy.deepcopy(model.embed_tokens)
            rank_module.embed_tokens.weight = rank_module.lm_head.weight
    stages = [(s, stage_module(rank_module, all_layers[s], s == 0, s == num_stages - 1)) for s in mine]
    return rank_module, stages


class Pipeline:
    """The stages of this rank and their schedule; `forward_backward` replaces the loop's own."""

    def __init__(self, rank_module: nn.Module, stages: list, parallel, mesh: DeviceMesh, device: torch.device):
        p = parallel
        self.rank_module = rank_module
        self.stages = stages
        self.modules = [module for _, module in stages]
        self.device = device
        self.group = mesh["pp"].get_group()
        self.schedule_name = p.pp_schedule
        self.num_stages = p.pp * p.vpp
        self.microbatches = p.pp_microbatches
        self.tied = rank_module.cfg.tie_word_embeddings
        self.schedule = None
        self._ce, self._aux, self._scale = [], [], None
        self.tied_group = None
        last_pp = 0 if p.pp_schedule in V_SCHEDULES else p.pp - 1
        if self.tied and last_pp != 0:
            # one group per (dp, cp, tp) coordinate: the pipeline ranks holding the first and the last stage
            ends = mesh.mesh[[0, last_pp]].reshape(2, -1).t().tolist()
            self.tied_group, _ = dist.new_subgroups_by_enumeration(ends)
        for index, module in stages:
            if index == self.num_stages - 1:
                module.register_forward_hook(_losses_as_vectors)
            if index > 0 and rank_module.has_moe:
                module.register_forward_pre_hook(_moe_stats_as_keyword, with_kwargs=True)
        if p.tp > 1 and p.sequence_parallel:
            for index, module in stages:
                _send_local_sequence_shards(module, mesh["tp"], first=index == 0, last=index == self.num_stages - 1)

    def _build_schedule(self, num_microbatches: int) -> None:
        if self.rank_module.has_moe:
            for _, module in self.stages:
                _forget_first_expert_load(module)
        pipeline_stages = [PipelineStage(module, index, self.num_stages, self.device, group=self.group)
                           for index, module in self.stages]
        schedule_class = get_schedule_class(self.schedule_name)
        # Losses are sums already divided by the step's global token count: gradients must not be rescaled.
        if issubclass(schedule_class, PipelineScheduleSingle):
            pipeline_stages = pipeline_stages[0]
        self.schedule = schedule_class(pipeline_stages, num_microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output, target):
        ce_sum, aux = output[0].sum(), output[1].sum()
        self._ce.append(ce_sum.detach())
        self._aux.append(aux.detach())
        return ce_sum / self._scale[0] + aux / self._scale[1]

    def forward_backward(self, micro_batches: List[Dict[str, torch.Tensor]], num_targets: torch.Tensor,
                         dp_size: int) -> tuple:
        """One step's forward and backward over the pipeline; returns (ce_sum, aux_sum) of this dp rank."""
        if self.schedule is None:
            self._build_schedule(self.microbatches or len(micro_batches))
        batch = {k: torch.cat([mb[k] for mb in micro_batches]) for k in micro_batches[0]}
        self._ce, self._aux = [], []
        self._scale = (num_targets, self.schedule._n_microbatches * dp_size)
        kwargs = {k: batch[k] for k in ("labels", "position_ids", "document_ids") if k in batch}
        if self.holds(0):
            self.schedule.step(batch["tokens"], target=batch["labels"], **kwargs)
        else:
            self.schedule.step(target=batch["labels"], **kwargs)
        zero = torch.zeros((), device=num_targets.device)
        # the first step also runs one forward (and loss) to infer the stages' shapes: keep the real ones
        n = self.schedule._n_microbatches
        totals = torch.stack([sum(self._ce[-n:], zero), sum(self._aux[-n:], zero)])
        dist.all_reduce(totals, group=self.group)  # only the last stage computed them
        if self.tied:
            self._sum_tied_grads()
        return totals[0], totals[1]

    def describe(self) -> str:
        """What ran, in one line: the schedule's class and every pipeline rank's stages with their layers (a
        collective over the pipeline ranks; call it on all of them once the first step has built the schedule)."""
        mine = [(index, sorted(map(int, module.layers))) for index, module in self.stages]
        held = [None] * self.group.size()
        dist.all_gather_object(held, mine, group=self.group)
        ranks = "; ".join(f"pp rank {r}: " + ", ".join(f"stage {s} (layers {', '.join(map(str, ids)) or '-'})"
                                                       for s, ids in stages) for r, stages in enumerate(held))
        return (f"pipeline: {type(self.schedule).__name__}, {self.schedule._n_microbatches} micro-batches, "
                f"{self.num_stages} stages; {ranks}")

    @torch.no_grad()
    def forward_only(self, tokens: torch.Tensor, **kwargs):
        """The whole model's forward (no schedule): stage after stage, hidden states sent point to point.

        Returns on every pipeline rank what Qwen3.forward returns: (ce_sum, aux) with labels, else logits.
        Used for evaluation (ParallelModel's call). With sequence parallel, the
        sequence length must divide by tp.
        """
        owner = {index: rank for rank in range(self.group.size()) for index in self._stages_of(rank)}
        me = self.group.rank()
        modules = dict(self.stages)
        h = (tokens,)
        for index in range(self.num_stages):
            if owner[index] != me:
                continue
            if index > 0 and owner[index - 1] != me:  # hidden states (and MoE statistics)
                h = tuple(_recv(owner[index - 1], self.group, self.device)
                          for _ in range(1 + self.rank_module.has_moe))
            h = modules[index](*h, **kwargs)
            h = h if isinstance(h, tuple) else (h,)
            if index < self.num_stages - 1 and owner[index + 1] != me:
                for t in h:
                    _send(t, owner[index + 1], self.group)
        last = owner[self.num_stages - 1]
        if "labels" in kwargs and kwargs["labels"] is not None:
            out = torch.cat([t.reshape(1) for t in h]) if me == last else torch.zeros(2, device=self.device)
            dist.broadcast(out, group_src=last, group=self.group)
            return out[0], out[1]
        if me != last:
            return _recv(last, self.group, self.device, broadcast=True)
        _send(h[0], None, self.group, broadcast=True)
        return h[0]

    def _stages_of(self, pp_rank: int) -> List[int]:
        return stages_of_rank(pp_rank, self.group.size(), self.num_stages // self.group.size(), self.schedule_name)

    def holds(self, stage_index: int) -> bool:
        return any(index == stage_index for index, _ in self.stages)

    def retie(self) -> None:
        """After materialization: the last stage's module-level tie points at the stage's (sharded) head."""
        m = self.rank_module
        if self.tied and m.lm_head is not None and not self.holds(0):
            m.embed_tokens.weight = m.lm_head.weight

    def _sum_tied_grads(self) -> None:
        """Sum the gradients of the first stage's embedding and the last stage's head (over the pipeline)."""
        m = self.rank_module
        weights = [module.weight for module in (m.embed_tokens, m.lm_head)
                   if module is not None and module.weight.requires_grad]  # LoRA freezes them
        weights = list({id(w): w for w in weights}.values())  # the last stage's tie is one tensor
        if not weights:
            return
        for w in weights:
            if isinstance(w.grad, DTensor) and w.grad.placements != w.placements:
                # a vocab-parallel embedding's gradient can come back replicated: shard it like the weight
                w.grad = w.grad.redistribute(placements=w.placements)
        grads = [_local(w.grad) for w in weights]
        total = grads[0] + grads[1] if len(grads) == 2 else grads[0].clone()
        if self.tied_group is not None:
            dist.all_reduce(total, group=self.tied_group)
        for g in grads:
            g.copy_(total)


def _losses_as_vectors(module, args, output):
    """(ce_sum, aux) as 1-element tensors: the schedule concatenates the last stage's outputs."""
    return tuple(t.reshape(1) for t in output) if isinstance(output, tuple) else output


def _forget_first_expert_load(stage: nn.Module) -> None:
    """Keep the stage's first forward out of its MoE layers' expert load: on a schedule's first step torch runs
    every stage once more to infer shapes (past the first stage on uninitialized tensors)."""
    saved, handles = {}, []

    def before(module, args):
        saved.update(take_expert_load(module))

    def after(module, args, output):
        take_expert_load(module)
        for layer, tally in saved.items():
            module.layers[str(layer)].mlp.load_tally.copy_(tally)
        for handle in handles:
            handle.remove()

    handles += [stage.register_forward_pre_hook(before), stage.register_forward_hook(after)]


def _moe_stats_as_keyword(module, args, kwargs):
    """A MoE stage receives (hidden states, running statistics): the statistics go to forward's moe_stats."""
    return args[:1], {**kwargs, "moe_stats": args[1]}


_DTYPES = tuple(DTYPES.values())  # a dtype travels in the header as its index here


def _send(t: torch.Tensor, dst: Optional[int], group, broadcast: bool = False) -> None:
    """Send a 2-D or 3-D tensor with a header (shape, dtype) to group rank `dst`, or broadcast it from here."""
    shape = [1] * (3 - t.dim()) + list(t.shape)
    header = torch.tensor([*shape, t.dim(), _DTYPES.index(t.dtype)], device=t.device)
    if broadcast:
        dist.broadcast(header, group_src=group.rank(), group=group)
        dist.broadcast(t.contiguous(), group_src=group.rank(), group=group)
    else:
        dist.send(header, group_dst=dst, group=group)
        dist.send(t.contiguous(), group_dst=dst, group=group)


def _recv(src: int, group, device: torch.device, broadcast: bool = False) -> torch.Tensor:
    header = torch.empty(5, dtype=torch.int64, device=device)
    (dist.broadcast if broadcast else dist.recv)(header, group_src=src, group=group)
    t = torch.empty(header[3 - int(header[3]):3].tolist(), dtype=_DTYPES[int(header[4])], device=device)
    (dist.broadcast if broadcast else dist.recv)(t, group_src=src, group=group)
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _send_local_sequence_shards(stage: nn.Module, tp_mesh: DeviceMesh, first: bool, last: bool) -> None:
    """With sequence parallel, stages exchange their local sequence shard [B, S/tp, D] and rebuild the DTensor.

    The model reads B and S from the hidden states, so a stage must see the sequence-sharded DTensor (global
    shape), while point-to-point sends take plain tensors.
    """
    if not first:
        stage.register_forward_pre_hook(
            lambda module, args: (DTensor.from_local(args[0], tp_mesh, [Shard(1)], run_check=False), *args[1:]))
    if not last:  # a MoE stage's statistics travel as they are
        stage.register_forward_hook(lambda module, args, output: (output[0].to_local(), *output[1:])
                                    if isinstance(output, tuple) else output.to_local())
