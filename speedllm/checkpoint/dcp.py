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

A checkpoint root may be a URL (`s3://bucket/run`, see speedllm.storage): object stores have no rename, so there
each step is written in place (through DCP's fsspec writer) and only `latest` - one object, written after every
rank's upload finished - marks it complete; the run's `config.yaml` and `metrics.jsonl` are uploaded beside it. A
failed write is retried (SAVE_ATTEMPTS in all, every rank together); then the run stops with one line and `latest`
still names the previous checkpoint. Loading with `auto` only ever follows `latest`.
"""

import contextlib
import io
import os
import pickle
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from speedllm import storage
from speedllm.checkpoint.hf import write_release
from speedllm.errors import UserError, one_line, reading
from speedllm.models.config import ModelConfig
from speedllm.outputs import MARKER, make_scratch_dir, remove_ours

LATEST = "latest"
SAVE_ATTEMPTS = 3  # a failed checkpoint write is tried again this often in all, after 1 s, 2 s ...
UPLOADED_BESIDE = ("config.yaml", "metrics.jsonl")  # the run's files copied beside remote checkpoints

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


class _SafeMetadata:
    """DCP's reader with `.metadata` read through a restricted unpickler (torch's uses plain pickle.load)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except OSError as e:
            raise UserError(f"{path} cannot be read ({e.strerror or one_line(e)}); point checkpoint.load at a "
                            "complete checkpoint") from None
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


class SafeReader(_SafeMetadata, FileSystemReader):
    pass


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    pass


def _reader(path) -> FileSystemReader:
    if storage.is_url(path):
        url, options = storage.fsspec_target(path)
        return SafeFsspecReader(url, **options)
    return SafeReader(str(path))


def _writer(path) -> FileSystemWriter:
    if storage.is_url(path):
        url, options = storage.fsspec_target(path)
        return FsspecWriter(url, **options)
    return FileSystemWriter(str(path))


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


def read_metadata(path) -> Metadata:
    """The `.metadata` of checkpoint directory `path` (a local path or a URL), read without running code."""
    return _reader(path).read_metadata()


def dcp_load(state: Dict[str, Any], path) -> None:
    """dcp.load, in place, with no unpickling of arbitrary objects; a checkpoint that does not fit (another model,
    truncated files) is one line naming it."""
    read_metadata(path)  # refused here, in one line, before DCP (which logs a traceback for a bad one)
    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=_reader(path), planner=SafePlanner(),
                     no_dist=not dist.is_initialized())
    except CheckpointException as e:  # a BaseException: DCP gathers each rank's failure into it
        first = _failure(e)
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


def finished_checkpoints(root) -> list:
    """Finished checkpoint directories under `root`, oldest first (on object storage: those up to `latest`, the
    only mark of a complete one there)."""
    if not storage.is_url(root):
        return sorted(p for p in Path(root).glob("step_*") if p.is_dir())
    newest = latest_checkpoint(root)
    if newest is None:
        return []
    return [storage.join(root, n) for n in storage.list_names(root)
            if n.startswith("step_") and n <= storage.name(newest)]


def latest_checkpoint(root):
    """The checkpoint `latest` names (a Path, or a URL under a URL root), or None if the root has none yet."""
    pointer = storage.join(root, LATEST)
    if not storage.is_file(pointer):
        return None
    path = storage.join(root, storage.read_text(pointer).strip())
    if not storage.is_file(storage.join(path, ".metadata")):
        raise UserError(f"{pointer} names {storage.name(path)}, which is missing or incomplete; write the name of a "
                        "complete step_* directory into it, or point checkpoint.load at one")
    return path


def _trained_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    """(model, optimizer) state dicts without the frozen parameters, and the options to load them back.

    Frozen parameters (the base under LoRA adapters) stay out of training checkpoints: they come from their own
    source (speedllm.checkpoint.adapters), so an adapter checkpoint is small. (StateDictOptions.ignore_frozen_params
    keeps the second name of a tied weight, so the names are filtered here.)
    """
    frozen = _frozen_names(model)
    options = StateDictOptions(strict=not frozen, flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {k: v for k, v in model_sd.items() if k not in frozen}, optim_sd, options


def _frozen_names(model: nn.Module) -> set:
    return {n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters(remove_duplicate=False)
            if not p.requires_grad}


def _start(root, step: int, group=None) -> tuple:
    """(final directory, directory written) of checkpoint `step`, the second made fresh by rank 0: a temporary one
    renamed when complete, or on object storage (no rename) the final one, which `latest` marks complete. The
    ranks then meet in a barrier of `group` (None: the default group)."""
    final = storage.join(root, step_dir_name(step))
    remote = storage.is_url(root)
    tmp = final if remote else Path(root) / f".{final.name}.tmp"

    def attempt() -> None:
        if storage.exists(final) and not storage.exists(storage.join(final, MARKER)):
            raise UserError(f"{final} exists and was not written by SpeedLLM; move it away or choose another "
                            "checkpoint.dir")
        if remote:
            if storage.exists(final):
                storage.remove(final)  # a leftover of a failed save of this step
            storage.write_text(storage.join(final, MARKER), "", "checkpoint.dir")
        else:
            make_scratch_dir(tmp, "checkpoint.dir")  # replaces one left by a process killed mid-write

    if _rank() == 0:
        _with_retries(f"preparing {final}", attempt, every_rank=False)
    if dist.is_initialized():
        dist.barrier(group=group)
    return final, tmp


def _failure(e: BaseException) -> BaseException:
    """The first rank's failure inside DCP's CheckpointException (which gathers every rank's), else `e`."""
    return next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e


def _with_retries(what: str, attempt, group=None, every_rank: bool = True) -> None:
    """Run `attempt()` until it succeeds, SAVE_ATTEMPTS times at most; with `every_rank`, the ranks agree after
    each try (all retry when any failed). The last failure is one line."""
    for n in range(1, SAVE_ATTEMPTS + 1):
        error = None
        try:
            attempt()
        except UserError:
            raise
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the storage's own errors, whatever they are
            error = _failure(e)
        failed = error is not None
        if every_rank and dist.is_initialized():
            flag = torch.tensor([int(failed)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            failed = bool(flag.item())
        if not failed:
            return
        if n == SAVE_ATTEMPTS:
            reason = one_line(error) if error is not None else "failed on another rank"
            raise UserError(f"checkpoint.dir: {what} failed {SAVE_ATTEMPTS} times ({reason}); `latest` still names "
                            "the previous checkpoint - check the storage, then resume with checkpoint.load=auto")
        time.sleep(n)


def _write(tmp, state: Dict[str, Any], extra: bytes, config: str, group, release_from=None) -> None:
    """Every rank writes its files of one checkpoint into `tmp`: DCP's model + optimizer, its `extra`, and on
    rank 0 the frozen config and the release files of `release_from` (checkpoint.hf.write_release); retried
    together (see _with_retries)."""
    def attempt() -> None:
        with storage.open_file(storage.join(tmp, f"extra_rank{_rank()}.pt"), "wb") as f:
            f.write(extra)
        if _rank() == 0:
            with storage.open_file(storage.join(tmp, "config.yaml"), "w") as f:
                f.write(config)
            write_release(release_from, tmp)
        with _quiet_dcp():
            dcp.save(state, storage_writer=_writer(tmp), process_group=group, no_dist=not dist.is_initialized())

    _with_retries(f"writing {tmp}", attempt, group)


def _small(extra: Dict[str, Any], cfg: DictConfig) -> tuple:
    """This rank's `extra` state as torch.save bytes and the frozen config as YAML: taken now, written later."""
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    return buffer.getvalue(), OmegaConf.to_yaml(cfg, resolve=True)


def _publish(root, tmp, final, keep: int, run_dir: str) -> None:
    """Rank 0, once every rank's files are written: put it in place, point `latest` at it, keep the newest. On
    object storage the run's config.yaml and metrics.jsonl go beside the checkpoints first."""
    def attempt() -> None:
        if storage.is_url(root):
            for name in UPLOADED_BESIDE:
                if (Path(run_dir) / name).is_file():
                    storage.put(Path(run_dir) / name, storage.join(root, name))
        else:
            remove_ours(final)  # a re-run of the same step replaces its old copy
            os.replace(tmp, final)
        storage.write_text(storage.join(root, LATEST), storage.name(final) + "\n", "checkpoint.dir")
        if keep > 0:
            for old in finished_checkpoints(root)[:-keep]:
                if storage.exists(storage.join(old, MARKER)):  # a step_* directory we did not write is never deleted
                    storage.remove(old)

    _with_retries(f"publishing {final}", attempt, every_rank=False)


def save_checkpoint(root, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: Dict[str, Any], cfg: DictConfig, keep: int, group=None, release_from=None) -> Path:
    """Write checkpoint `step` on every rank, then publish it as `latest` and keep the newest `keep`.

    Args:
        root: the checkpoint root, a local path or a URL.
        extra: this rank's small state (step, scheduler, loader, RNG) saved with torch.save.
        keep: number of finished checkpoints to keep; <= 0 keeps all.
        group: the process group of DCP's collectives (None: the default one).
        release_from: the checkpoint or HF directory whose release files (config, vision tower, MTP) this one keeps.
    """
    final, tmp = _start(root, step)
    model_sd, optim_sd, _ = _trained_state(model, optimizer)
    _write(tmp, {"model": model_sd, "optim": optim_sd}, *_small(extra, cfg), group, release_from)
    _barrier()
    if _rank() == 0:
        _publish(root, tmp, final, keep, getattr(cfg, "run_dir", "."))
    _barrier()
    return final


class Checkpointer:
    """Saves a run's checkpoints: synchronously (save_checkpoint), or with `async_save` in the background.

    An async save blocks training only while DCP's stager copies the state into host memory (so training may go on
    changing the weights); the files are written by a background thread, which then waits for every rank and has
    rank 0 publish the checkpoint exactly as a synchronous save does (rename, `latest`, keep). The next save and
    `close()` (the end of training) wait for a pending one, so `latest` only ever names a complete checkpoint, and a
    process killed mid-write leaves only the `.tmp` directory. Checkpoint collectives (DCP's planning, the retry
    agreement, the barrier) use their own gloo process group, apart from training's.
    """

    def __init__(self, root: str, keep: int, async_save: bool, release_from: Optional[str] = None):
        self.root, self.keep, self.async_save = storage.location(root), keep, async_save
        # a release's tensors beside the text model travel from checkpoint to checkpoint: copied from where the
        # run started, then from its own newest checkpoint (the start may be pruned by `keep`)
        self.release_from = release_from
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        if async_save and not dist.is_initialized():
            # DCP warns from its writer thread that it saves without a process group: intended here
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        self.executor = ThreadPoolExecutor(max_workers=1) if async_save else None
        # One stager for the run: it keeps its host copy between saves, so later saves stage without allocating.
        self.stager = DefaultStager(StagingOptions(False, False, False, False)) if async_save else None
        self.pending: Optional[Future] = None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Dict[str, Any],
             cfg: DictConfig):
        """Save checkpoint `step` (see save_checkpoint); async: return once it is staged, before it is written."""
        self.wait()
        if not self.async_save:
            final = save_checkpoint(self.root, step, model, optimizer, extra, cfg, self.keep, self.group,
                                    self.release_from)
            self.release_from = self.release_from and final
            return final
        model_sd, optim_sd, _ = _trained_state(model, optimizer)
        staged = self.stager.stage({"model": model_sd, "optim": optim_sd})
        self.pending = self.executor.submit(self._finish, step, staged, _small(extra, cfg),
                                            getattr(cfg, "run_dir", "."))
        return storage.join(self.root, step_dir_name(step))

    def _finish(self, step: int, staged: Dict[str, Any], small: tuple, run_dir: str) -> None:
        final, tmp = _start(self.root, step, self.group)  # here too: on object storage that is a few requests
        _write(tmp, staged, *small, self.group, self.release_from)
        if self.group is not None:
            dist.barrier(group=self.group)  # every rank's files are written
        if _rank() == 0:
            _publish(self.root, tmp, final, self.keep, run_dir)
        self.release_from = self.release_from and final

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


def read_saved_config(step_dir) -> DictConfig:
    """The run config saved inside a checkpoint (`config.yaml`), checked to be one."""
    frozen = storage.join(step_dir, "config.yaml")
    with reading(str(frozen), "copy the run directory's config.yaml over it, or point checkpoint.load at another "
                 "checkpoint"):
        saved = OmegaConf.create(storage.read_text(frozen))
    if not isinstance(saved, DictConfig) or not isinstance(saved.get("model"), DictConfig):
        raise UserError(f"{frozen} is not a SpeedLLM run config (no model section); copy the run directory's "
                        "config.yaml over it, or point checkpoint.load at another checkpoint")
    # a checkpoint saved before a model field existed has that field's default (e.g. no layer_types: Qwen3)
    saved.model = OmegaConf.merge(OmegaConf.structured(ModelConfig), saved.model)
    return saved


def saved_task(step_dir) -> Optional[str]:
    """The task (task.name) of the run that saved checkpoint `step_dir`; None when it holds no config.yaml."""
    if not storage.is_file(storage.join(step_dir, "config.yaml")):
        return None
    return OmegaConf.select(read_saved_config(step_dir), "task.name")


def started_from(step_dir, task: str):
    """The checkpoint of another task whose weights the run of `step_dir` (a checkpoint of `task`) started from:
    `step_dir` itself if another task saved it, else the one its resumes lead back to (each checkpoint's config
    names the checkpoint it loaded); None for a run that started from seeded or HF weights."""
    path, seen = step_dir, set()
    while path is not None and str(path) not in seen:
        seen.add(str(path))
        saved = saved_task(path)
        if saved is None:
            return None
        if saved != task:
            return path
        load = OmegaConf.select(read_saved_config(path), "checkpoint.load")
        path = None if load in (None, "auto") else resolve_load(load, "")
    return None


def resolve_load(load: Optional[str], root: str):
    """Turn `checkpoint.load` into a checkpoint directory.

    `auto` means the run's latest checkpoint if there is one (else start fresh); a path may name a
    checkpoint directory or a checkpoint root holding a `latest` file.
    """
    if load is None:
        return None
    if load == "auto":
        return latest_checkpoint(root)
    path = storage.location(load)
    if storage.is_file(storage.join(path, ".metadata")):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise UserError(f"checkpoint.load={load}: no DCP checkpoint there (no .metadata, no '{LATEST}' file); "
                        "point it at a step_* directory or a checkpoints directory, or use checkpoint.load=auto")
    return latest


def load_checkpoint(path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """Load model + optimizer in place (any layout) and return this rank's `extra` state."""
    model_sd, optim_sd, options = _trained_state(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
    extra_file = storage.join(path, f"extra_rank{_rank()}.pt")
    if not storage.is_file(extra_file):
        # more ranks than the checkpoint was written with: replicated state (step, RNG seed stream) from rank 0
        extra_file = storage.join(path, "extra_rank0.pt")
    with reading(f"checkpoint.load: {extra_file}", DAMAGED_FIX):
        try:
            with storage.open_file(extra_file, "rb") as f:
                return torch.load(f, weights_only=True)
        except pickle.UnpicklingError:  # torch's message is a page of advice on allow-listing globals
            raise ValueError("it holds a pickled object, not plain data; torch.load(weights_only=True) refused to "
                             "run it") from None


def load_weights(path, model: nn.Module) -> None:
    """Only the trained weights of checkpoint `path` into `model`, in place (any layout): a run starting from
    another task's checkpoint leaves its optimizer state, step, data position and RNG behind."""
    frozen = _frozen_names(model)
    options = StateDictOptions(strict=not frozen)
    state = {k: v for k, v in get_model_state_dict(model, options=options).items() if k not in frozen}
    dcp_load({"model": state}, path)
    set_model_state_dict(model, state, options=options)
