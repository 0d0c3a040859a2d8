"""The run config: typed schema (schema.py), cross-field rules (validate.py) and its registration with Hydra."""

import os

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from speedllm.config.schema import OPTIMIZERS, RunConfig
from speedllm.paths import ASSETS, CONF


def _hf_model(path, key):
    """`${hf_model:<HF dir>,<field>}`: one ModelConfig field read from an HF config.json (conf/model/hf.yaml)."""
    from speedllm.checkpoint.hf import hf_model_field

    return hf_model_field(path, key)


def _cpu_dtype():
    """`${cpu_dtype:}`: what hardware.dtype=auto picks on this CPU (conf/hardware/cpu.yaml)."""
    from speedllm.hardware import cpu_dtype, cpu_probe, isa_features

    return cpu_dtype(cpu_probe(), isa_features())


def _cpu_peaks():
    """`${cpu_peaks:}`: this CPU's peak_tflops per dtype, its GEMM probe's (conf/hardware/cpu.yaml)."""
    from speedllm.hardware import cpu_peaks

    return cpu_peaks()


def _cache_home() -> str:
    """`${cache_home:}`: data.cache_dir's default, SPEEDLLM_CACHE or $HOME/.cache/speedllm (a variable set to ""
    counts as unset: it would be the working directory)."""
    return os.environ.get("SPEEDLLM_CACHE") or f"{os.environ.get('HOME') or '.'}/.cache/speedllm"


def register_configs() -> None:
    """Register the root schema, the `${asset:...}` resolver (absolute path under the bundled assets),
    `${hf_model:...}`, `${cache_home:}`, and `${cpu_dtype:}` / `${cpu_peaks:}` (this CPU's measured choice and peaks)."""
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", lambda rel: str(ASSETS / rel))
    if not OmegaConf.has_resolver("hf_model"):
        OmegaConf.register_new_resolver("hf_model", _hf_model, use_cache=True)
    if not OmegaConf.has_resolver("cache_home"):
        OmegaConf.register_new_resolver("cache_home", _cache_home)
    if not OmegaConf.has_resolver("cpu_dtype"):
        OmegaConf.register_new_resolver("cpu_dtype", _cpu_dtype)
        OmegaConf.register_new_resolver("cpu_peaks", _cpu_peaks)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for schema in OPTIMIZERS.values():
        cs.store(name=f"optim_{schema.name}_schema", node=schema)  # no group: not an option --help lists


def compose_config(*overrides: str) -> DictConfig:
    """The run config `speedllm <overrides>` would compose (no launch, no validation)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


__all__ = ["RunConfig", "compose_config", "register_configs"]
