"""Hardware profiles: `hardware=auto` detection and loading a profile from conf/hardware/."""

import importlib.util

import torch
from omegaconf import DictConfig, OmegaConf

from speedllm.config.schema import HardwareConfig
from speedllm.paths import CONF

# hardware.dtype (and convert.dtype) names
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
