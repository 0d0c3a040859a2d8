"""LoRA adapters in PEFT's directory format, both ways.

A PEFT adapter directory holds `adapter_config.json` (LoraConfig: r, lora_alpha, target_modules, …) and
`adapter_model.safetensors`, whose names are the transformers model's module names under `base_model.model.`
with `lora_A.weight` / `lora_B.weight` appended (`peft.PeftModel.from_pretrained(base, dir)` reads exactly
this). Our names are transformers' without its `model.` prefix, so the map is a prefix.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional

import torch

from speedllm.adapters.lora import copy_full_, is_adapter, unwrapped
from speedllm.errors import UserError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model."


def to_peft_name(name: str) -> str:
    return PREFIX + name


def from_peft_name(name: str) -> str:
    return name.removeprefix(PREFIX).replace(".default.", ".")  # some PEFT versions keep the adapter name


def adapter_config(ft, targets: List[str], base: Optional[str]) -> dict:
    """PEFT's LoraConfig fields for our finetune config and the module names that hold adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": ft.rank,
            "lora_alpha": ft.alpha, "lora_dropout": ft.dropout, "target_modules": targets,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None}


def write_peft_dir(out: str, ft, tensors: Dict[str, torch.Tensor], base: Optional[str]) -> Path:
    """Write our adapter tensors (our names, whole tensors) as a PEFT directory; temp name, then rename."""
    from safetensors.torch import save_file

    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()):
        raise UserError(f"convert.out={out} exists and is not empty; choose a new directory or remove it")
    tmp = out_path.parent / f".{out_path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({to_peft_name(k): v.detach().to("cpu").contiguous() for k, v in tensors.items()},
              str(tmp / WEIGHTS), metadata={"format": "pt"})
    # the names that were adapted, not finetune.targets: on a MoE model peft would map gate/up/down_proj to the
    # experts' fused weights, which hold no adapters here
    targets = sorted({name.split(".")[-3] for name in tensors})  # layers.0.self_attn.q_proj.lora_A.weight
    (tmp / CONFIG).write_text(json.dumps(adapter_config(ft, targets, base), indent=2, sort_keys=True) + "\n")
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
    targets = config.get("target_modules")
    # PEFT saves the names that matched (a MoE model's attention only), ours may list more; loading then
    # checks that every module we adapt has its tensors
    if not isinstance(targets, list) or not set(targets) <= set(ft.targets):
        raise UserError(f"finetune.adapter={path}: adapter target_modules={targets} but finetune.targets="
                        f"{list(ft.targets)}; set finetune.targets=[{','.join(targets or [])}]")
    if config.get("target_parameters"):
        raise UserError(f"finetune.adapter={path}: adapter has LoRA on MoE expert weights (target_parameters="
                        f"{config['target_parameters']}), which finetune=lora does not hold; use an adapter on "
                        "attention / dense MLP projections (PEFT: target_modules only)")
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
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise UserError(f"finetune.adapter={path}: {name} has shape {list(tensors[name].shape)} but the model "
                            f"needs {list(param.shape)}; the adapter belongs to another model")
        copy_full_(param, tensors[name].to(param.dtype))
