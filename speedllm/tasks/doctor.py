"""task=doctor: check every rank's host, device, backend and mesh position with a verified all-reduce."""

import os
import platform
import socket

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from speedllm.errors import UserError
from speedllm.runtime import Runtime


def _report(cfg: DictConfig, rt: Runtime) -> dict:
    versions = {"torch": torch.__version__, "cuda": torch.version.cuda or "-"}
    if cfg.hardware.device == "npu":
        import torch_npu

        versions["torch_npu"] = torch_npu.__version__
    coordinate = dict(zip(rt.mesh.mesh_dim_names, rt.mesh.get_coordinate())) if rt.mesh is not None else {}
    return {"rank": rt.rank, "local_rank": rt.local_rank, "host": socket.gethostname(), "device": str(rt.device),
            "backend": cfg.hardware.backend if rt.world_size > 1 else "none", "mesh": coordinate,
            "python": platform.python_version(), **versions}


def cpu_kernels() -> str:
    """Which code path each CPU kernel runs on this machine (speedllm.native; SPEEDLLM_CPU_ISA forces one)."""
    from speedllm.native import ISA_ENV, cpu_name, kernel_path, supported_isas
    from speedllm.ops import batch_invariant, cpu
    from speedllm.quant import int4, int8

    return (f"cpu kernels on {cpu_name()} ({ISA_ENV}={os.environ.get(ISA_ENV) or 'unset'}; paths here: "
            f"{', '.join(supported_isas())}): int8 matmul {kernel_path(int8.KERNEL_SOURCE)}, int4 matmul "
            f"{kernel_path(int4.KERNEL_SOURCE)}, rms_norm/swiglu/rotary {kernel_path(cpu.KERNEL_SOURCE)}, int8_dyn "
            f"dot products {int8.int8_dot_variant()}, batch-invariant bf16 matmul {batch_invariant.bf16_path()}")


def cpu_compute(cfg: DictConfig) -> str:
    """What this CPU computes and how fast (speedllm.hardware): its ISA features, the GEMM probe per dtype, what
    hardware.dtype=auto picks from it and what this run uses."""
    from speedllm.hardware import cpu_dtype, cpu_probe, isa_features, probe_file

    gflops = cpu_probe()
    rates = ", ".join(f"{name} {rate:g}" for name, rate in gflops.items())
    return (f"cpu features: {' '.join(isa_features()) or 'none known'}; GEMM probe at {torch.get_num_threads()} "
            f"threads (GFLOP/s): {rates} ({probe_file()}; delete it to measure again); hardware.dtype=auto picks "
            f"{cpu_dtype(gflops, isa_features())}; this run: {cfg.hardware.dtype}")


def run(cfg: DictConfig, rt: Runtime) -> None:
    report = _report(cfg, rt)
    # Each rank contributes rank+1; the sum over the world is known in closed form.
    value = torch.tensor([float(rt.rank + 1)], device=rt.device)
    if rt.world_size > 1:
        dist.all_reduce(value)
        reports = [None] * rt.world_size
        dist.all_gather_object(reports, report)
    else:
        reports = [report]
    expected = rt.world_size * (rt.world_size + 1) / 2
    ok = value.item() == expected
    if rt.is_main:
        for r in reports:
            mesh = " ".join(f"{k}={v}" for k, v in r["mesh"].items()) or "-"
            print(f"rank {r['rank']:>3} local {r['local_rank']:>2} host {r['host']} device {r['device']} "
                  f"backend {r['backend']} mesh [{mesh}] torch {r['torch']} cuda {r['cuda']}"
                  + (f" torch_npu {r['torch_npu']}" if "torch_npu" in r else ""))
        hosts = len({r["host"] for r in reports})
        print(f"doctor: {len(reports)}/{rt.world_size} ranks on {hosts} host(s) reported; all-reduce "
              f"{'ok' if ok else 'WRONG'} (sum {value.item():g}, expected {expected:g}); hardware={cfg.hardware.name}")
        print(cpu_kernels())
        if cfg.hardware.device == "cpu":
            print(cpu_compute(cfg))
    if not ok:
        raise UserError(f"all-reduce over {rt.world_size} ranks returned {value.item():g} instead of {expected:g}; "
                        f"check the network / backend {cfg.hardware.backend}")
