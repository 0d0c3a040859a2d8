"""Adapter checkpoints: the frozen base of an adapter run (where it comes from, loading it; QLoRA's NF4 base:
speedllm.quant.nf4), and the adapters read back whole for export (a PEFT directory, or merged full HF weights).

The base is an HF directory (checkpoint.load_hf) or a DCP checkpoint without adapters (checkpoint.load naming
a full-weights checkpoint, e.g. one task=convert convert.to=dcp wrote). An adapter run's own checkpoints hold
only the adapters (and their optimizer state); resuming one finds its base through the frozen config.yaml
saved with it, following earlier resumes back to the run that named the base.
"""

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from torch import nn

from speedllm.adapters.lora import is_adapter, merged_state_dict, target_linears, unwrapped
from speedllm.checkpoint.dcp import dcp_load, read_metadata, read_saved_config, resolve_load
from speedllm.errors import UserError
from speedllm.quant.nf4 import NF4_BYTES, fill_nf4_, is_nf4


def holds_adapters(ckpt: Path) -> bool:
    """True when a DCP checkpoint's model is LoRA adapters only (an adapter run's checkpoint)."""
    keys = read_metadata(ckpt).state_dict_metadata
    return any(key.startswith("model.") and is_adapter(key) for key in keys)


def base_source(ckpt: Path) -> Tuple[str, str]:
    """("hf", dir) or ("dcp", checkpoint) of the base an adapter checkpoint was trained on."""
    seen = set()
    while ckpt not in seen:
        seen.add(ckpt)
        saved = read_saved_config(ckpt)
        load_hf, load = OmegaConf.select(saved, "checkpoint.load_hf"), OmegaConf.select(saved, "checkpoint.load")
        if load_hf is not None:
            return "hf", load_hf
        if load is None or load == "auto":
            break
        previous = resolve_load(load, saved.checkpoint.dir)
        if not holds_adapters(previous):
            return "dcp", str(previous)
        ckpt = previous
    raise UserError(f"checkpoint.load={ckpt}: its config.yaml names no base model (checkpoint.load_hf); set "
                    "checkpoint.load_hf=<HF dir> to the base the adapters were trained on")


@torch.no_grad()
def load_dcp_base(modules: List[nn.Module], ckpt: Path) -> None:
    """The base weights (every non-adapter tensor) of a DCP checkpoint into this rank's model parts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    for module in modules:
        # QLoRA's NF4 base: read whole, quantized as in one process (speedllm.quant.nf4)
        nf4 = {unwrapped(name): p for name, p in module.named_parameters() if is_nf4(p)}
        full = {name: torch.empty(p.shape) for name, p in nf4.items()}
        state = {k: v for k, v in get_model_state_dict(module).items() if not is_adapter(k) and k not in nf4}
        dcp_load({"model": {**state, **full}}, ckpt)
        set_model_state_dict(module, state, options=StateDictOptions(strict=False))
        for name, param in nf4.items():
            fill_nf4_(param, full[name])


def base_bytes(model_cfg, ft) -> dict:
    """Parameter counts and bytes of an adapter run's model, from the meta model: the frozen base (NF4 for the
    adapted projections under QLoRA, fp32 otherwise) and the trained adapters (fp32)."""
    from speedllm.adapters.lora import apply_lora
    from speedllm.models.qwen3 import Qwen3

    with torch.device("meta"):
        model = Qwen3(model_cfg)
    apply_lora(model, ft.rank, ft.alpha, ft.dropout, ft.targets)
    adapted = target_linears(model, ft.targets).values()
    quantized = [linear.weight.numel() for linear in adapted] if ft.name == "qlora" else []
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    base = sum(p.numel() for p in params if not p.requires_grad)
    adapters = sum(p.numel() for p in params if p.requires_grad)
    nf4_bytes = sum(quantized) * NF4_BYTES + 4 * len(quantized)
    return {"base_params": base, "base_bytes": (base - sum(quantized)) * 4 + nf4_bytes,
            "adapter_params": adapters}


def load_base(modules: List[nn.Module], cfg, resume_from: Optional[Path]) -> Optional[Path]:
    """Fill the frozen base of an adapter model, start the adapters from finetune.adapter when given, and
    quantize the base for QLoRA. Returns the adapter checkpoint to resume from (None: a fresh start)."""
    from speedllm.checkpoint.hf import load_hf_weights

    ck, ft = cfg.checkpoint, cfg.finetune
    base = None
    if resume_from is not None and not holds_adapters(resume_from):
        base, resume_from = ("dcp", str(resume_from)), None  # checkpoint.load named full weights: the base
    if ck.load_hf is not None:
        base = ("hf", ck.load_hf)
    elif base is None and resume_from is not None:
        base = base_source(resume_from)
    if base is not None:
        kind, path = base
        if kind == "hf":
            load_hf_weights(modules, path)
        else:
            load_dcp_base(modules, Path(path))
    if resume_from is None and ft.adapter is not None:
        from speedllm.adapters.peft import load_peft_adapter

        load_peft_adapter(modules, ft.adapter, ft)
    return resume_from


def read_adapters(ckpt: Path) -> Dict[str, torch.Tensor]:
    """Every adapter tensor of a DCP checkpoint, whole, under our names."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(ckpt).state_dict_metadata
    state = {key.removeprefix("model."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in metadata.items()
             if key.startswith("model.") and is_adapter(key) and isinstance(meta, TensorStorageMetadata)}
    dcp_load({"model": state}, ckpt)
    return state


def export_peft(ckpt: Path, out: str) -> Path:
    """The adapters of checkpoint `ckpt` as a PEFT LoRA directory (for PeftModel.from_pretrained)."""
    from speedllm.adapters.peft import write_peft_dir

    saved = read_saved_config(ckpt)
    kind, base = base_source(ckpt)
    return write_peft_dir(out, saved.finetune, read_adapters(ckpt), base if kind == "hf" else None,
                          saved.model)


def export_merged(ckpt: Path, out: str, cfg, dtype) -> Path:
    """Base + scaling * B @ A for every adapted weight, written as an HF directory (transformers loads it)."""
    from speedllm.checkpoint.hf import load_hf_weights, write_hf_dir
    from speedllm.models.qwen3 import Qwen3

    saved = read_saved_config(ckpt)
    with torch.device("meta"):
        model = Qwen3(saved.model)
    model.to_empty(device="cpu")
    model.tie_embeddings()
    kind, base = base_source(ckpt)
    if kind == "hf":
        load_hf_weights(model, base)
    else:
        load_dcp_base([model], Path(base))
    ft = saved.finetune
    merged = merged_state_dict({**model.state_dict(), **read_adapters(ckpt)}, ft.alpha / ft.rank)
    tensors = {name: (tuple(t.shape), t.dtype) for name, t in merged.items()}
    return write_hf_dir(out, saved.model, tensors, lambda names: {n: merged[n] for n in names},
                        cfg.convert.max_shard_size, dtype, base if kind == "hf" else None,
                        OmegaConf.select(saved, "data.tokenizer"), cfg.logging.progress_bar)
