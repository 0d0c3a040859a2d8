"""task=convert for adapter checkpoints: a PEFT adapter directory, or merged full HF weights.

    python launch.py task=convert checkpoint.load=<run>/checkpoints convert.to=peft convert.out=<dir>
    python launch.py task=convert checkpoint.load=<run>/checkpoints convert.to=hf convert.merge_lora=true \
        convert.out=<dir>

One process on the CPU; the checkpoint may come from any parallel layout (DCP stores whole tensors).
"""

from pathlib import Path
from typing import Dict

import torch
from omegaconf import OmegaConf

from speedllm.checkpoint.dcp import dcp_load, read_metadata, read_saved_config
from speedllm.finetune.base import base_source, load_dcp_base
from speedllm.finetune.lora import is_adapter, merged_state_dict


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
    from speedllm.finetune.peft import write_peft_dir

    saved = read_saved_config(ckpt)
    kind, base = base_source(ckpt)
    return write_peft_dir(out, saved.finetune, read_adapters(ckpt), base if kind == "hf" else None)


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
