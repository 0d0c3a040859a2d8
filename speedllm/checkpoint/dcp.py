"""Atomic, layout-independent training checkpoints with torch.distributed.checkpoint (DCP).

On disk, under the checkpoint root (cfg.checkpoint.dir):

    step_00000100/            one finished checkpoint
        .metadata, *.distcp   model + optimizer (DCP, resharded on load to any parallel layout)
        extra_rank<r>.pt      this rank's step, scheduler, data-loader position and RNG states
        config.yaml           the frozen run config
    .step_00000200.tmp/       a checkpoint being written (renamed when complete)
    latest                    text file naming the newest finished checkpoint

A process killed while writing leaves only a `.tmp` directory behind; `latest` still names the previous,
complete checkpoint, because it is replaced (atomically) only after the rename.
"""

import contextlib
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from speedllm.errors import UserError

LATEST = "latest"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _quiet_dcp():
    """DCP works without a process group but warns about it on every call; here that case is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def finished_checkpoints(root: Path) -> list:
    """Finished checkpoint directories under `root`, oldest first."""
    return sorted(p for p in root.glob("step_*") if p.is_dir())


def latest_checkpoint(root: str) -> Optional[Path]:
    """The checkpoint `latest` names, or None if the root has none yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    return Path(root) / pointer.read_text().strip()


def _trained_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """(model, optimizer) state dicts without the frozen parameters, and the options to load them back.

    Frozen parameters (the base under LoRA adapters) stay out of training checkpoints: they come from their own
    source (speedllm.finetune.base), so an adapter checkpoint is small. (StateDictOptions.ignore_frozen_params
    keeps the second name of a tied weight, so the names are filtered here.)
    """
    frozen = {n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters(remove_duplicate=False)
              if not p.requires_grad}
    options = StateDictOptions(strict=not frozen)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd, options


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: Dict[str, Any], cfg: DictConfig, keep: int) -> Path:
    """Write checkpoint `step` on every rank, then publish it as `latest` and keep the newest `keep`.

    Args:
        extra: this rank's small state (step, scheduler, loader, RNG) saved with torch.save.
        keep: number of finished checkpoints to keep; <= 0 keeps all.
    """
    root_path = Path(root)
    final = root_path / step_dir_name(step)
    tmp = root_path / f".{final.name}.tmp"
    rank = _rank()
    if rank == 0:
        root_path.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed mid-write
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd, _ = _trained_state(model, optimizer)
    with _quiet_dcp():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    torch.save(extra, tmp / f"extra_rank{rank}.pt")
    if rank == 0:
        OmegaConf.save(cfg, tmp / "config.yaml", resolve=True)
    _barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # a re-run of the same step replaces its old copy
        os.replace(tmp, final)
        pointer_tmp = root_path / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name + "\n")
        os.replace(pointer_tmp, root_path / LATEST)
        if keep > 0:
            for old in finished_checkpoints(root_path)[:-keep]:
                shutil.rmtree(old)
    _barrier()
    return final


def resolve_load(load: Optional[str], root: str) -> Optional[Path]:
    """Turn `checkpoint.load` into a checkpoint directory.

    `auto` means the run's latest checkpoint if there is one (else start fresh); a path may name a
    checkpoint directory or a checkpoint root holding a `latest` file.
    """
    if load is None:
        return None
    if load == "auto":
        return latest_checkpoint(root)
    path = Path(load)
    if (path / ".metadata").is_file():
        return path
    latest = latest_checkpoint(str(path))
    if latest is None:
        raise UserError(f"checkpoint.load={load}: no DCP checkpoint there (no .metadata, no '{LATEST}' file); "
                        "point it at a step_* directory or a checkpoints directory, or use checkpoint.load=auto")
    return latest


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """Load model + optimizer in place (any layout) and return this rank's `extra` state."""
    model_sd, optim_sd, options = _trained_state(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    extra_file = path / f"extra_rank{_rank()}.pt"
    if not extra_file.is_file():
        # more ranks than the checkpoint was written with: replicated state (step, RNG seed stream) from rank 0
        extra_file = path / "extra_rank0.pt"
    return torch.load(extra_file, weights_only=True)
