"""Hardware profiles: their schema (HardwareConfig), `hardware=auto` detection, loading one from conf/hardware/."""

import importlib.util
from dataclasses import dataclass, field
from typing import Dict

import torch
from omegaconf import DictConfig, OmegaConf

from speedllm.paths import CONF

# hardware.dtype (and convert.dtype) names
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



@dataclass
class HardwareConfig:
    """A device profile: what to run on and how fast it is (used for MFU and the planner)."""

    name: str = "auto"
    device: str = "cpu"  # cpu | cuda | npu
    backend: str = "gloo"  # gloo | nccl | hccl
    ops: str = "reference"  # op implementations: reference | cpu | cuda | npu
    dtype: str = "float32"  # compute dtype (bf16 on GPU/NPU with fp32 master weights)
    memory_gb: float = 16.0  # memory per device
    peak_tflops: Dict[str, float] = field(default_factory=lambda: {"float32": 0.1, "bfloat16": 0.01})
    memory_bandwidth_gbps: float = 20.0
    intra_node_bandwidth_gbps: float = 10.0
    inter_node_bandwidth_gbps: float = 1.0
    devices_per_node: int = 8
    env: Dict[str, str] = field(default_factory=dict)
    float8: bool = False  # float8 matmuls (NVIDIA SM 8.9+: H100/H200/L40/RTX 40xx); gates quant=float8

def npu_available() -> bool:
    """True when torch_npu is installed and sees a device. Imported only if present: it needs the Ascend toolkit."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401

    return torch.npu.is_available()


def detect() -> str:
    """The profile `hardware=auto` stands for: npu if torch_npu sees a device, else cuda (h100/h200 by name), else cpu."""
    if npu_available():
        return "npu_a3" if "910C" in torch.npu.get_device_name(0) else "npu_a2"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return "h200" if "H200" in name else "h100" if "H100" in name else "cuda"
    return "cpu"


def load_profile(name: str) -> DictConfig:
    """A profile from conf/hardware/<name>.yaml, typed by the schema."""
    return OmegaConf.merge(OmegaConf.structured(HardwareConfig), OmegaConf.load(CONF / "hardware" / f"{name}.yaml"))
