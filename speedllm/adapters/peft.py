"""LoRA adapters in PEFT's directory format, both ways.

A PEFT adapter directory holds `adapter_config.json` (LoraConfig: r, lora_alpha, target_modules, …) and
`adapter_model.safetensors`, whose names are the transformers model's module names under `base_model.model.`
with `lora_A.weight` / `lora_B.weight` appended (`peft.PeftModel.from_pretrained(base, dir)` reads exactly
this). Our names are transformers' without its `model.` prefix, so the map is a prefix.

Adapters on MoE experts are PEFT's `target_parameters` on transformers' fused `mlp.experts.gate_up_proj`
[E, 2I, D] and `mlp.experts.down_proj` [E, D, I] (peft.tuners.lora.ParamWrapper). PEFT wraps the experts
module once per parameter, in sorted order: down_proj's wrapper outside (`mlp.experts.lora_A.weight`),
gate_up_proj's inside it (`mlp.experts.base_layer.lora_A.weight`). Its A [E·r, in] stacks the experts' A
(row e·r + j), its B [out, r·E] interleaves them (column j·E + e); ours are [E, r, in] and [E, out, r].
A B on Gated DeltaNet's in_proj_qkv has its base's rows, in our order of q, k, v (speedllm.models.hf_adapter).
"""

import json
import os
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import torch

from speedllm.adapters.lora import copy_full_, is_adapter, unwrapped
from speedllm.errors import UserError
from speedllm.models.hf_adapter import hf_rows

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model."
TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
_WRAPPER = {"gate_up": "experts.base_layer", "down": "experts"}  # our fused name -> PEFT's module
_OURS = re.compile(r"^(layers\.\d+\.mlp)\.experts\.adapter\.(lora_[AB])\.(gate_up|down)$")
_PEFTS = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(base_layer\.)?(lora_[AB])\.weight$")


def to_peft(name: str, tensor: torch.Tensor, model_cfg) -> tuple:
    """(PEFT's name, PEFT's tensor) of one of our adapter weights."""
    expert = _OURS.match(name)
    if expert is None:
        return PREFIX + name, hf_rows(name, tensor, model_cfg)
    prefix, side, fused = expert.groups()
    if side == "lora_A":
        tensor = tensor.reshape(-1, tensor.shape[-1])
    else:
        tensor = tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)
    return f"{PREFIX}{prefix}.{_WRAPPER[fused]}.{side}.weight", tensor


def from_peft_name(name: str) -> str:
    name = name.removeprefix(PREFIX).replace(".default.", ".")  # some PEFT versions keep the adapter name
    expert = _PEFTS.match(name)
    if expert is None:
        return name
    prefix, inner, side = expert.groups()
    return f"{prefix}.experts.adapter.{side}.{'gate_up' if inner else 'down'}"


def from_peft_tensor(name: str, tensor: torch.Tensor, model_cfg) -> torch.Tensor:
    """PEFT's tensor as ours (`name`: ours); one that does not split into the experts stays as it is."""
    if _OURS.match(name) is None:
        return hf_rows(name, tensor, model_cfg, to_hf=False)
    num_experts = model_cfg.num_experts
    if tensor.ndim != 2:
        return tensor
    if ".lora_A." in name:  # [E·r, in] -> [E, r, in]
        return tensor if tensor.shape[0] % num_experts else tensor.reshape(num_experts, -1, tensor.shape[-1])
    if tensor.shape[1] % num_experts:
        return tensor
    return tensor.reshape(tensor.shape[0], -1, num_experts).permute(2, 0, 1)  # [out, r·E] -> [E, out, r]


def adapter_config(ft, targets: List[str], base: Optional[str]) -> dict:
    """PEFT's LoraConfig fields for our finetune config and the module names that hold adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": ft.rank,
            "lora_alpha": ft.alpha, "lora_dropout": ft.dropout, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None}


def write_peft_dir(out: str, ft, tensors: Dict[str, torch.Tensor], base: Optional[str], model_cfg) -> Path:
    """Write our adapter tensors (our names, whole tensors, of model config `model_cfg`) as a PEFT directory; temp
    name, then rename."""
    from safetensors.torch import save_file

    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()):
        raise UserError(f"convert.out={out} exists and is not empty; choose a new directory or remove it")
    tmp = out_path.parent / f".{out_path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(dict(to_peft(k, v.detach().to("cpu").contiguous(), model_cfg) for k, v in tensors.items()),
              str(tmp / WEIGHTS), metadata={"format": "pt"})
    # the module names that were adapted (layers.0.self_attn.q_proj.lora_A.weight), not finetune.targets: on a
    # MoE model peft would map gate/up/down_proj to the experts' fused weights, adapted by target_parameters
    dense = [name for name in tensors if _OURS.match(name) is None]
    config = adapter_config(ft, sorted({name.split(".")[-3] for name in dense}), base)
    if len(dense) < len(tensors):
        config["target_parameters"] = TARGET_PARAMETERS
    (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if out_path.exists():
        out_path.rmdir()
    os.replace(tmp, out_path)
    return out_path


def read_peft_config(path: str, ft) -> dict:
    """adapter_config.json, checked against finetune.rank / alpha / targets (one-line errors with the fix)."""
    config_file = Path(path) / CONFIG
    if not config_file.is_file() or not (Path(path) / WEIGHTS).is_file():
        raise UserError(f"finetune.adapter={path}: no {CONFIG} + {WEIGHTS} there; point it at a PEFT LoRA "
                        "adapter directory (PeftModel.save_pretrained or task=convert convert.to=peft)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type") != "LORA":
        raise UserError(f"finetune.adapter={path}: peft_type {config.get('peft_type')!r} is not LORA; only LoRA "
                        "adapters load")
    if config.get("r") != ft.rank:
        raise UserError(f"finetune.adapter={path}: adapter r={config.get('r')} but finetune.rank={ft.rank}; set "
                        f"finetune.rank={config.get('r')}")
    if float(config.get("lora_alpha", 8)) != float(ft.alpha):
        raise UserError(f"finetune.adapter={path}: adapter lora_alpha={config.get('lora_alpha')} but finetune.alpha="
                        f"{ft.alpha}; set finetune.alpha={config.get('lora_alpha')}")
    targets = config.get("target_modules") or []
    parameters = config.get("target_parameters") or []
    wanted = targets + (["experts"] if parameters else [])
    # PEFT saves the names that matched (a MoE model's attention only), ours may list more; loading then
    # checks that every module we adapt has its tensors
    if not isinstance(targets, list) or not set(wanted) <= set(ft.targets):
        raise UserError(f"finetune.adapter={path}: adapter target_modules={targets} target_parameters={parameters} "
                        f"but finetune.targets={list(ft.targets)}; set finetune.targets=[{','.join(wanted)}]")
    if parameters and sorted(parameters) != sorted(TARGET_PARAMETERS):
        raise UserError(f"finetune.adapter={path}: adapter target_parameters={parameters}; LoRA on the experts "
                        f"adapts {' and '.join(TARGET_PARAMETERS)} together, so only such adapters load")
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            raise UserError(f"finetune.adapter={path}: {key}=true adapters are not supported; use a plain LoRA one")
    return config


@torch.no_grad()
def load_peft_adapter(modules: List[torch.nn.Module], path: str, ft) -> None:
    """Fill the adapters of this rank's model parts from a PEFT directory (each rank keeps its own slices)."""
    from safetensors.torch import load_file

    read_peft_config(path, ft)
    tensors = {from_peft_name(k): v for k, v in load_file(str(Path(path) / WEIGHTS)).items()}
    ours = {unwrapped(name): p for module in modules for name, p in module.named_parameters() if is_adapter(name)}
    missing = sorted(ours.keys() - tensors.keys())
    if missing:
        raise UserError(f"finetune.adapter={path}: no adapter for {missing[0]} (and {len(missing) - 1} more); the "
                        "adapter was trained on other modules — set finetune.targets to its target_modules")
    for name, param in ours.items():
        tensor = from_peft_tensor(name, tensors[name], modules[0].cfg)
        if tuple(tensor.shape) != tuple(param.shape):
            raise UserError(f"finetune.adapter={path}: {name} has shape {list(tensor.shape)} but the model "
                            f"needs {list(param.shape)}; the adapter belongs to another model")
        copy_full_(param, tensor.to(param.dtype).contiguous())
