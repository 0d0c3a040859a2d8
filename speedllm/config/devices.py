"""The machine: node 0's rendezvous host and the hardware profile's devices (not for planning).
"""

from omegaconf import DictConfig

from speedllm.errors import UserError


def check_rendezvous(cfg: DictConfig) -> None:
    """Several nodes: node 0's host must resolve here (an unresolvable one would hang the rendezvous)."""
    import socket

    lc = cfg.launcher
    if lc.nnodes == 1 or lc.rdzv_backend not in ("c10d", "static"):
        return
    host, _, port = lc.rdzv_endpoint.rpartition(":")
    try:
        socket.getaddrinfo(host, int(port))
    except (socket.gaierror, ValueError) as e:
        raise UserError(f"launcher.rdzv_endpoint={lc.rdzv_endpoint}: {host or '(no host)'} does not resolve here "
                        f"({e}); give node 0's host name or address and a port, like node0:29500") from None


def check_device(cfg: DictConfig, nproc_per_node: int) -> None:
    """The hardware profile's device must be here (not for planning, which targets machines the user lacks)."""
    import torch

    hw = cfg.hardware
    if hw.device == "cpu":
        return
    if hw.device == "cuda":
        found = torch.cuda.device_count()
    else:
        from speedllm.hardware import npu_available

        found = torch.npu.device_count() if npu_available() else 0
    if found < nproc_per_node:
        raise UserError(f"hardware={hw.name} needs {nproc_per_node} {hw.device} device(s) per node but {found} "
                        f"found here; use hardware=cpu (or hardware=auto), or lower launcher.nproc_per_node")
