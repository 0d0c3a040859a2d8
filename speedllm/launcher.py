"""Freeze a composed config and run it: in this process, or as N ranks through PyTorch's elastic launcher.

`speedllm.cli` (the only @hydra.main, behind `launch.py` and the `speedllm` command) hands the composed config
to `launch()`. Spawned workers run `python -m speedllm.launcher <run_dir>/config.yaml`: they read the frozen
config and never re-run Hydra.
"""

import os
import sys
import uuid
from pathlib import Path

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict

from speedllm.config import register_configs
from speedllm.config.resolve import resolve
from speedllm.config.schema import typed
from speedllm.config.validate import validate
from speedllm.console import console_log, discard_run_dir, guarded, scrub_run_files
from speedllm.errors import UserError, one_line
from speedllm.runtime import Runtime, init_runtime, under_torchrun

FROZEN_NAME = "config.yaml"
KEEPS_NOTHING = ("plan", "dryrun", "doctor")  # tasks whose run directory is removed when they succeed
NO_DEVICES = ("plan", "dryrun")  # tasks about a job on devices this machine may lack: a plain CPU runtime


def write_frozen(cfg: DictConfig, run_dir: Path) -> Path:
    """Write the fully resolved config atomically (temp name, then rename) and return its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / FROZEN_NAME
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    OmegaConf.save(cfg, tmp)
    os.replace(tmp, path)
    return path


def run_task(cfg, rt: Runtime) -> None:
    """Call the task's `_target_` (conf/task/<name>.yaml) with the run as typed objects."""
    from hydra.utils import get_method

    from speedllm.ops import batch_invariant

    cfg = typed(cfg)
    with batch_invariant.mode(cfg.hardware.batch_invariant):
        get_method(cfg.task._target_)(cfg, rt)


def _spawn(cfg: DictConfig, frozen: Path, nproc: int) -> None:
    """Run the frozen job as nproc local ranks (x nnodes) through torch's elastic launcher (torchrun's engine)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    lc = cfg.launcher
    rdzv_configs = {"rank": lc.node_rank} if lc.rdzv_backend == "static" else {}
    rdzv_configs.update(timeout=int(lc.rdzv_timeout), join_timeout=int(lc.rdzv_timeout),
                        read_timeout=int(lc.rdzv_timeout))
    config = LaunchConfig(
        min_nodes=lc.nnodes, max_nodes=lc.nnodes, nproc_per_node=nproc,
        run_id="speedllm" if lc.nnodes > 1 else uuid.uuid4().hex[:8],
        rdzv_backend=lc.rdzv_backend, rdzv_endpoint=lc.rdzv_endpoint, rdzv_configs=rdzv_configs,
        max_restarts=lc.max_restarts, monitor_interval=lc.monitor_interval, start_method="spawn",
    )
    try:
        elastic_launch(config, sys.executable)("-m", "speedllm.launcher", str(frozen))
    except RendezvousError as e:
        raise UserError(f"launcher.rdzv_endpoint={lc.rdzv_endpoint}: no rendezvous with {lc.nnodes} node(s) within "
                        f"launcher.rdzv_timeout={lc.rdzv_timeout}s ({one_line(e)}); start the same command on every "
                        "node with node 0's host:port, or raise launcher.rdzv_timeout") from None
    except SignalException as e:
        # SIGTERM/SIGINT reached the agent, which passed it on to the ranks and waited for them (a server stops, a
        # training run saves its checkpoint): the documented way to stop a run, exit 0 as in one process
        print(f"stopped by {e.sigval.name}", file=sys.stderr)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        ranks = ", ".join(str(r) for r in sorted(e.failures))
        print(f"error: rank(s) {ranks} failed (exit code {', '.join(map(str, codes))}); their output is above",
              file=sys.stderr)
        raise SystemExit(2 if codes == [2] else 1) from None


def _run_under_torchrun(cfg: DictConfig) -> None:
    """torchrun started every rank with Hydra: agree on rank 0's run dir, then run as a worker."""
    rt = init_runtime(cfg)
    run_dir = [str(cfg.run_dir)]
    dist.broadcast_object_list(run_dir, src=0)
    cfg.run_dir = run_dir[0]
    OmegaConf.resolve(cfg)
    if rt.is_main:
        write_frozen(cfg, Path(cfg.run_dir))
    run_rank(cfg, rt)


def freeze_and_run(cfg: DictConfig) -> None:
    world, nproc = resolve(cfg)  # fill in what the user left to us (hardware, checkpoint's model, layout) ...
    scrub_run_files(Path(cfg.run_dir))  # URL credentials: masked in the config since resolve, now in Hydra's too
    validate(cfg, world, nproc)  # ... then one pre-flight pass over the final config
    cfg.run_dir = str(Path(cfg.run_dir).absolute())
    if under_torchrun():
        return _run_under_torchrun(cfg)
    OmegaConf.resolve(cfg)
    frozen = write_frozen(cfg, Path(cfg.run_dir))
    if cfg.task.name not in KEEPS_NOTHING:
        print(f"run dir: {cfg.run_dir}")
    if world == 1 or cfg.task.in_process:
        run_task(cfg, Runtime() if cfg.task.name in NO_DEVICES else init_runtime(cfg, distributed=False))
    else:
        _spawn(cfg, frozen, nproc)


def launch(cfg: DictConfig) -> int:
    """Entry from launch.py; returns the exit status. Every failure is one line (user errors: status 2); a run
    that kept nothing (plan, doctor, a refused config) leaves no run directory."""
    with open_dict(cfg):
        run_dir = Path(str(cfg.run_dir)).absolute()
        with console_log(run_dir) as log:
            status = guarded(lambda: freeze_and_run(cfg), log, run_dir)
    scrub_run_files(run_dir)
    if status == 2 or (status == 0 and cfg.task.name in KEEPS_NOTHING):
        discard_run_dir(run_dir)
    return status


def run_rank(cfg: DictConfig, rt: Runtime) -> None:
    """Run the task as one rank of a job, tear the process groups down together, and exit the process."""

    def task() -> None:
        run_task(cfg, rt)
        dist.barrier()  # no rank tears its process groups down while a peer may still talk to it

    run_dir = Path(cfg.run_dir)
    with console_log(run_dir) as log:
        try:
            status = guarded(task, log, run_dir, prefix=f"[rank {rt.rank}] ")
        finally:
            dist.destroy_process_group()
    # Skip the interpreter's teardown: gloo's C++ worker threads can abort it ("terminate called without an
    # active exception") after the job is done. Everything the task wrote is closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def worker_main(frozen: str) -> None:
    """One rank of a spawned job: read the frozen config and run the task (never re-runs Hydra)."""
    register_configs()
    cfg = OmegaConf.load(frozen)
    run_rank(cfg, init_runtime(cfg))


if __name__ == "__main__":
    worker_main(sys.argv[1])
