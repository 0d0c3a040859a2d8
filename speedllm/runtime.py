"""Per-process runtime: rank, device, process group and device mesh, set up once per worker."""

import datetime
import os
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from speedllm.native import keep_freed_memory
from speedllm.parallel.mesh import ParallelDims, build_mesh


@dataclass
class Runtime:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    mesh: Optional["dist.DeviceMesh"] = None
    ep: int = 1  # expert parallel degree (carved out of the mesh's dp x cp axes)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.mesh, self.ep)


def under_torchrun() -> bool:
    """True when torchrun (or another elastic agent) started this process as one rank of a job."""
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def device_for(cfg: DictConfig, local_rank: int) -> torch.device:
    kind = cfg.hardware.device
    if kind == "cpu":
        keep_freed_memory()  # no page faults on every step's large tensors
        return torch.device("cpu")
    if kind == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)
    getattr(torch, kind).set_device(local_rank)
    return torch.device(kind, local_rank)


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> "dist.Store":
    """The rendezvous store, with keys private to this attempt of an elastic job.

    After a restart (launcher.max_restarts) torch 2.13's agent store still holds the previous attempt's
    process-group keys, and gloo then dials dead peers; a per-attempt prefix keeps the attempts apart.
    """
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_it, timeout=timeout)
    return dist.PrefixStore(f"speedllm/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_runtime(cfg: DictConfig, distributed: bool = True) -> Runtime:
    """Set the hardware profile's environment, the device, the process group (if several ranks) and the mesh.

    Rank, world size and rendezvous come from the environment that torchrun / the elastic agent sets.
    """
    for key, value in cfg.hardware.env.items():
        os.environ.setdefault(key, str(value))
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if distributed else 1
    rank = int(os.environ.get("RANK", "0")) if distributed else 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if distributed else 0
    device = device_for(cfg, local_rank)
    mesh = None
    # offload is FSDP2's, which needs a mesh: a single process gets a 1-rank group (an in-memory store)
    if world_size > 1 or cfg.parallel.offload != "none":
        if not dist.is_initialized():
            timeout = datetime.timedelta(minutes=10)
            store = _attempt_store(rank, world_size, timeout) if world_size > 1 else dist.HashStore()
            backend = cfg.hardware.backend
            if cfg.parallel.offload == "params" and device.type != "cpu":
                # gradients and their norm live in host memory: their collectives need a CPU backend beside
                backend = f"{device.type}:{backend},cpu:gloo"
            dist.init_process_group(backend, timeout=timeout, store=store, rank=rank,
                                    world_size=world_size, device_id=device if device.type != "cpu" else None)
        mesh = build_mesh(cfg.parallel, device.type)
    seed_everything(cfg.seed)
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=device, mesh=mesh,
                   ep=cfg.parallel.ep if mesh is not None else 1)


def init_fake_runtime(cfg, rank: int, world_size: int) -> Runtime:
    """Rank `rank` of a `world_size`-rank job on torch's fake process group: the mesh and every process group
    are built as on the real job, collectives do nothing (task=dryrun, with the model on the meta device).
    Destroys a previous (fake) default group, so one process can play several ranks in turn."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    mesh = build_mesh(cfg.parallel, "cpu")
    return Runtime(rank=rank, world_size=world_size, device=torch.device("meta"), mesh=mesh, ep=cfg.parallel.ep)


__all__ = ["Runtime", "init_fake_runtime", "init_runtime", "seed_everything", "under_torchrun"]
