"""Measure what the planner predicts: peak bytes of live tensor storage, and what a sharded model holds.

`PeakTensorMemory` counts every storage an op allocates while it is active (unwrapping DTensor to its
local tensor), follows FSDP2's `resize_` of its unsharded buffers, and subtracts storages when Python frees
them: the CPU analogue of `torch.cuda.max_memory_allocated`, without allocator caching or fragmentation.
Tensors alive before it starts (the weights) are passed as `existing`, so that views of them are not
counted again.
"""

import json
import os
import socket
import weakref
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _plain_tensors(t: torch.Tensor):
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                yield from _plain_tensors(inner)
    else:
        yield t


class PeakTensorMemory(TorchDispatchMode):
    """`with PeakTensorMemory(existing=model.parameters()) as tracker: ...` then `tracker.peak` (bytes)."""

    def __init__(self, existing=()):
        super().__init__()
        self.live = {}  # storage key -> bytes
        self.current = 0
        self.peak = 0
        self._resize = None
        for t in existing:
            self._track(t)

    def _add(self, key, nbytes: int) -> None:
        self.current += nbytes - self.live.get(key, 0)
        self.live[key] = nbytes
        self.peak = max(self.peak, self.current)

    def _free(self, key) -> None:
        self.current -= self.live.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        for plain in _plain_tensors(t):
            if plain.device.type == "meta":
                continue
            storage = plain.untyped_storage()
            key = storage._cdata
            if key in self.live:
                continue
            self._add(key, storage.nbytes())
            weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def __enter__(self):
        tracker = self
        self._resize = original = torch.UntypedStorage.resize_

        def resize_(storage, size):
            result = original(storage, size)
            key = storage._cdata
            if key in tracker.live:
                tracker._add(key, size)
            elif size > 0:
                tracker._add(key, size)
                weakref.finalize(storage, tracker._free, key)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


def held_numel(model: torch.nn.Module) -> int:
    """Parameter elements this rank stores (local shards of DTensors; a tied weight once)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for param in model.parameters():
        total += (param.to_local() if isinstance(param, DTensor) else param).numel()
    return total


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (local shards of DTensors)."""
    seen = {}
    for t in tensors:
        for plain in _plain_tensors(t):
            storage = plain.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def optimizer_states(optimizer: torch.optim.Optimizer) -> list:
    """The optimizer's per-parameter state tensors (AdamW's moments; scalar step counters left out)."""
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]


def measure_training_step(cfg, rt) -> dict:
    """Build the model as training does, take one step, then measure a second one on this rank.

    Returns the parameter elements held, the bytes of weights, gradients (as the update sees them) and
    AdamW states, and the peak bytes of live tensors during the second step.
    """
    from speedllm.train.build import autocast_for, build_model, grad_accum_steps
    from speedllm.train.optimizer import build_optimizer
    from speedllm.train.schedule import build_scheduler
    from speedllm.train.step import train_step

    pm = build_model(cfg, rt)
    optimizer = build_optimizer(pm.module, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, 10)
    dp_rank, dp_size, group = rt.dims.coords("dp")
    t = cfg.train
    gen = torch.Generator().manual_seed(dp_rank)
    batches = [{k: torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, t.seq_len), generator=gen)
                for k in ("tokens", "labels")} for _ in range(grad_accum_steps(t, dp_size))]
    params = list(pm.module.parameters())
    grad_bytes = []
    optimizer.register_step_pre_hook(
        lambda *_: grad_bytes.append(storage_bytes([p.grad for p in params if p.grad is not None])))
    autocast = autocast_for(cfg, pm, rt.device)
    train_step(pm, optimizer, scheduler, batches, cfg, dp_size, group, autocast)  # creates AdamW's states
    states = optimizer_states(optimizer)
    tracker = PeakTensorMemory(existing=[*params, *states])
    with tracker:
        train_step(pm, optimizer, scheduler, batches, cfg, dp_size, group, autocast)
    return {"rank": rt.rank, "pp_rank": rt.mesh.get_coordinate()[0] if rt.mesh is not None else 0,
            "held": held_numel(pm.module), "param_bytes": storage_bytes(params), "grad_bytes": grad_bytes[-1],
            "optimizer_bytes": storage_bytes(states), "peak": tracker.peak}


def _rank_main(rank: int, world: int, port: int, jobs: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from speedllm.runtime import init_runtime

    for config, out in jobs:  # one process group for all: the first init_runtime starts it
        cfg = OmegaConf.create(config)
        p = cfg.parallel
        p.dp = world // (p.tp * p.pp * p.cp)
        cfg.run_dir = out
        record = measure_training_step(cfg, init_runtime(cfg))
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()
    dist.destroy_process_group()


def measure_layouts(cfgs: list, world: int, out_dirs: list) -> list:
    """measure_training_step for each composed config in turn, on one set of `world` spawned CPU ranks (gloo):
    a list of per-rank records for each config (written under its out dir)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # plain containers, resolved here: the ranks have no Hydra
    jobs = [(OmegaConf.to_container(OmegaConf.merge(cfg, {"run_dir": str(out)}), resolve=True), str(out))
            for cfg, out in zip(cfgs, out_dirs)]
    mp.spawn(_rank_main, args=(world, port, jobs), nprocs=world, join=True)
    return [[json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)] for out in out_dirs]


def measure_layout(cfg, world: int, out_dir) -> list:
    """measure_training_step on `world` spawned CPU ranks (gloo) of the composed config `cfg`."""
    return measure_layouts([cfg], world, [out_dir])[0]
