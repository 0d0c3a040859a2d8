"""Atomic, layout-independent training checkpoints with torch.distributed.checkpoint (DCP).

On disk, under the checkpoint root (cfg.checkpoint.dir):

    step_00000100/            one finished checkpoint
        .metadata, *.distcp   model + optimizer (DCP, resharded on load to any parallel layout; the optimizer
                              state and hyperparameters keyed by parameter name, so the parameter groups of
                              another layout - EP's per-mesh groups, one pipeline rank's - do not matter)
        extra_rank<r>.pt      this rank's step, scheduler, data-loader position and RNG states
        config.yaml           the frozen run config
    .step_00000200.tmp/       a checkpoint being written (renamed when complete)
    latest                    text file naming the newest finished checkpoint

A process killed while writing leaves only a `.tmp` directory behind; `latest` still names the previous,
complete checkpoint, because it is replaced (atomically) only after the rename. With checkpoint.async_save the
write happens in the background (`Checkpointer`), with the same rename and `latest` once every rank is done.
"""

import contextlib
import os
import pickle
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from speedllm.errors import UserError, reading
from speedllm.outputs import MARKER, make_scratch_dir, remove_ours, write_text_atomic

LATEST = "latest"

# What a DCP `.metadata` pickle may name: DCP's own metadata classes and the few torch/pathlib values inside them.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Refuses every global outside DCP's metadata classes, plain values and torch dtypes: no code runs."""

    def find_class(self, module: str, name: str):
        if name in _METADATA_GLOBALS.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a DCP checkpoint never holds")


class SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` read through a restricted unpickler (torch's uses plain pickle.load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except OSError as e:
            raise UserError(f"{path} cannot be read ({e.strerror}); point checkpoint.load at a complete checkpoint")
        except Exception as e:  # any malformed pickle: truncated, garbage, or naming code to run
            raise UserError(f"{path} is not a DCP checkpoint's metadata ({e}); refusing to load it - use a "
                            "checkpoint written by SpeedLLM or torch.distributed.checkpoint") from None
        if not isinstance(metadata, Metadata):
            raise UserError(f"{path} holds a {type(metadata).__name__}, not DCP metadata; point checkpoint.load at "
                            "a DCP checkpoint directory")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor entries read by torch.load(weights_only=True) (torch's allows any object)."""

    def load_bytes(self, read_item, value) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(f"checkpoint entry {read_item.dest_index.fqn} is a pickled object, not plain data "
                            "(torch.load(weights_only=True) refused it); refusing to load the checkpoint") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: Path) -> Metadata:
    """The `.metadata` of checkpoint directory `path`, read without running code."""
    return SafeReader(str(path)).read_metadata()


def dcp_load(state: Dict[str, Any], path: Path) -> None:
    """dcp.load, in place, with no unpickling of arbitrary objects; a checkpoint that does not fit (another model,
    truncated files) is one line naming it."""
    read_metadata(path)  # refused here, in one line, before DCP (which logs a traceback for a bad one)
    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(),
                     no_dist=not dist.is_initialized())
    except CheckpointException as e:  # a BaseException: DCP gathers each rank's failure into it
        first = next(iter(e.failures.values()))[0] if e.failures else e
        if isinstance(first, UserError):
            raise first from None
        reason = str(first).strip().splitlines()[-1] if str(first).strip() else type(first).__name__
        raise UserError(f"checkpoint {path} does not fit this model or is damaged ({type(first).__name__}: "
                        f"{reason[:300]}); point checkpoint.load at a complete checkpoint of this model") from None


DAMAGED_FIX = ("point checkpoint.load at a complete checkpoint written by SpeedLLM (an earlier step_* directory "
               "if this one is damaged)")


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
    path = Path(root) / pointer.read_text().strip()
    if not (path / ".metadata").is_file():
        raise UserError(f"{pointer} names {path.name}, which is missing or incomplete; write the name of a complete "
                        "step_* directory into it, or point checkpoint.load at one")
    return path


def _trained_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """(model, optimizer) state dicts without the frozen parameters, and the options to load them back.

    Frozen parameters (the base under LoRA adapters) stay out of training checkpoints: they come from their own
    source (speedllm.checkpoint.adapters), so an adapter checkpoint is small. (StateDictOptions.ignore_frozen_params
    keeps the second name of a tied weight, so the names are filtered here.)
    """
    frozen = {n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters(remove_duplicate=False)
              if not p.requires_grad}
    options = StateDictOptions(strict=not frozen, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd, options


def _start(root: str, step: int) -> tuple:
    """(root, final directory, temporary directory) of checkpoint `step`; the temporary one made fresh by rank 0."""
    root_path = Path(root)
    final = root_path / step_dir_name(step)
    tmp = root_path / f".{final.name}.tmp"
    if _rank() == 0:
        if final.exists() and not (final / MARKER).is_file():
            raise UserError(f"{final} exists and was not written by SpeedLLM; move it away or choose another "
                            "checkpoint.dir")
        make_scratch_dir(tmp, "checkpoint.dir")  # replaces one left by a process killed mid-write
    _barrier()
    return root_path, final, tmp


def _write_small(tmp: Path, extra: Dict[str, Any], cfg: DictConfig) -> None:
    torch.save(extra, tmp / f"extra_rank{_rank()}.pt")
    if _rank() == 0:
        OmegaConf.save(cfg, tmp / "config.yaml", resolve=True)


def _publish(root_path: Path, tmp: Path, final: Path, keep: int) -> None:
    """Rank 0, once every rank's files are written: rename into place, point `latest` at it, keep the newest."""
    remove_ours(final)  # a re-run of the same step replaces its old copy
    os.replace(tmp, final)
    write_text_atomic(root_path / LATEST, final.name + "\n", "checkpoint.dir")
    if keep > 0:
        for old in finished_checkpoints(root_path)[:-keep]:
            remove_ours(old)  # a step_* directory we did not write is never deleted


def save_checkpoint(root: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: Dict[str, Any], cfg: DictConfig, keep: int) -> Path:
    """Write checkpoint `step` on every rank, then publish it as `latest` and keep the newest `keep`.

    Args:
        extra: this rank's small state (step, scheduler, loader, RNG) saved with torch.save.
        keep: number of finished checkpoints to keep; <= 0 keeps all.
    """
    root_path, final, tmp = _start(root, step)
    model_sd, optim_sd, _ = _trained_state(model, optimizer)
    with _quiet_dcp():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    _write_small(tmp, extra, cfg)
    _barrier()
    if _rank() == 0:
        _publish(root_path, tmp, final, keep)
    _barrier()
    return final


class Checkpointer:
    """Saves a run's checkpoints: synchronously (save_checkpoint), or with `async_save` in the background.

    An async save blocks training only while DCP stages the state into host memory (a copy, so training may go on
    changing the weights); the files are written by a background thread, which then waits for every rank and has
    rank 0 publish the checkpoint exactly as a synchronous save does (rename, `latest`, keep). The next save and
    `close()` (the end of training) wait for a pending one, so `latest` only ever names a complete checkpoint, and a
    process killed mid-write leaves only the `.tmp` directory. The background collectives (DCP's planning, the
    barrier) use their own gloo process group, apart from training's.
    """

    def __init__(self, root: str, keep: int, async_save: bool):
        self.root, self.keep, self.async_save = root, keep, async_save
        self.group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        if async_save and not dist.is_initialized():
            # DCP warns from its writer thread that it saves without a process group: intended here
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        self.executor = ThreadPoolExecutor(max_workers=1) if async_save else None
        # One stager for the run: it keeps its host copy between saves, so later saves stage without allocating.
        self.stager = DefaultStager(StagingOptions(False, False, False, False)) if async_save else None
        self.pending: Optional[Future] = None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Dict[str, Any],
             cfg: DictConfig) -> Path:
        """Save checkpoint `step` (see save_checkpoint); async: return once it is staged, before it is written."""
        self.wait()
        if not self.async_save:
            return save_checkpoint(self.root, step, model, optimizer, extra, cfg, self.keep)
        root_path, final, tmp = _start(self.root, step)
        model_sd, optim_sd, _ = _trained_state(model, optimizer)
        _write_small(tmp, extra, cfg)
        with _quiet_dcp():
            upload = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp),
                                    process_group=self.group, async_stager=self.stager,
                                    no_dist=not dist.is_initialized())
        self.pending = self.executor.submit(self._finish, upload, root_path, tmp, final)
        return final

    def _finish(self, upload: Future, root_path: Path, tmp: Path, final: Path) -> None:
        upload.result()
        if self.group is not None:
            dist.barrier(group=self.group)  # every rank's files are written
        if _rank() == 0:
            _publish(root_path, tmp, final, self.keep)

    def wait(self) -> None:
        """Block until the pending async save (if any) is written and published on every rank."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.result()  # a failed write raises here
        _barrier()

    def close(self) -> None:
        """The end of training: wait for a pending save, then free the host copy and the writer thread."""
        self.wait()
        if self.async_save:
            self.stager.close()
            self.executor.shutdown()


def read_saved_config(step_dir: Path) -> DictConfig:
    """The run config saved inside a checkpoint (`config.yaml`), checked to be one."""
    frozen = step_dir / "config.yaml"
    with reading(str(frozen), "copy the run directory's config.yaml over it, or point checkpoint.load at another "
                 "checkpoint"):
        saved = OmegaConf.load(frozen)
    if not isinstance(saved, DictConfig) or not isinstance(saved.get("model"), DictConfig):
        raise UserError(f"{frozen} is not a SpeedLLM run config (no model section); copy the run directory's "
                        "config.yaml over it, or point checkpoint.load at another checkpoint")
    return saved


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
    dcp_load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    extra_file = path / f"extra_rank{_rank()}.pt"
    if not extra_file.is_file():
        # more ranks than the checkpoint was written with: replicated state (step, RNG seed stream) from rank 0
        extra_file = path / "extra_rank0.pt"
    with reading(f"checkpoint.load: {extra_file}", DAMAGED_FIX):
        try:
            return torch.load(extra_file, weights_only=True)
        except pickle.UnpicklingError:  # torch's message is a page of advice on allow-listing globals
            raise ValueError("it holds a pickled object, not plain data; torch.load(weights_only=True) refused to "
                             "run it") from None
